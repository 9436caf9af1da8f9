"""The background half of a save: write shards, commit locally, upload, commit durably, apply retention.

Two threads per rank, each with its own gloo group: the writer (DCP write, checksums, local manifest) and
the uploader (concurrent transfers with retries, durable manifest). Every decision that ranks must agree on
(did every rank succeed, which checkpoint to upload next) goes through the channel's agreement helper, so all
ranks take the same branch and no collective is left waiting on one side.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch.distributed.checkpoint as dcp

from resilience.checkpoint.save_events import SaveEvents
from resilience.checkpoint.save_handle import Commit, SaveHandle
from resilience.checkpoint.staging import StagingJob
from resilience.config import CheckpointConfig
from resilience.dist import Channel, Topology
from resilience.errors import CheckpointError, describe
from resilience.persist import Failures, PersistPipeline
from resilience.persist.dcp_write import PiecePlanner, RecordingWriter, space_hint, versions
from resilience.persist.transfer import Guarded, OnRetry, RetryPolicy, commit_durable, guarded, upload_files
from resilience.persist.worker import Worker
from resilience.storage import client_retries, proofs
from resilience.storage.catalog import scan
from resilience.storage.fencing import DurableGuard, being_healed, foreign_steps
from resilience.storage.layout import (
    DCP_METADATA,
    MANIFEST,
    STATE_FILE,
    WRITER_FILE,
    rank_state_file,
)
from resilience.storage.manifest import FileEntry, Manifest
from resilience.storage.peer_copies import CopySender, send_copy
from resilience.storage.retention import steps_to_delete
from resilience.storage.tiers import DurableTier, LocalTier, Tier, fsync_dir

log = logging.getLogger(__name__)


@dataclass
class WriteSpec:
    """One save as it crosses to a helper process: everything about it but its tensors, all picklable. Declared
    once, for both pipelines: a field added here reaches the helper with no copying by hand."""

    step: int
    skeleton: Any  # on the leader only: None elsewhere
    rank_skeleton: Any
    pickled: list[str]
    extra: dict[str, Any]
    block_s: float
    run_id: str | None = None
    writer: dict[str, Any] | None = None
    pieces: dict[str, list[Any]] = field(default_factory=dict)  # DCP write items of DTensor shards (helper)
    peer: tuple[str, int] | None = None  # the partner node's peer-copy server, for this rank's durable files


@dataclass(kw_only=True)
class WriteJob(WriteSpec):
    """One save for a pipeline: its description, and beside it what lives only in the process that runs it: the
    staging that fills its tensors, and the handle whose futures it resolves."""

    staging: StagingJob
    handle: SaveHandle

    def spec(self) -> WriteSpec:
        """This save's description alone, as a helper process is sent it."""
        return WriteSpec(**_description(self))

    @classmethod
    def of(cls, spec: WriteSpec, staging: StagingJob, handle: SaveHandle) -> WriteJob:
        """A job for a description received from another process, with this process's staging and handle."""
        return cls(**_description(spec), staging=staging, handle=handle)


def _description(spec: WriteSpec) -> dict[str, Any]:
    """A description's fields by name, shallow (``dataclasses.asdict`` would copy the skeletons)."""
    return {f.name: getattr(spec, f.name) for f in fields(WriteSpec)}


@dataclass
class UploadJob:
    step: int
    manifest: Manifest
    handle: SaveHandle
    peer: tuple[str, int] | None = None


class Pipeline(PersistPipeline):
    """Owns the writer and uploader threads of one rank, in the training process or in its helper process
    (:mod:`resilience.persist.helper_process`).

    Args:
        committed: Called with a step once it is committed locally (the manager's record of what exists).
        protected_steps: Steps retention must keep (a framework's names still refer to them).
        on_error: Where a failure goes (default: kept until :meth:`take_errors`), before its save's future ends.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        local: LocalTier,
        durable: DurableTier | None,
        topology: Topology,
        writer_channel: Channel,
        upload_channel: Channel,
        local_shared: bool,
        events: SaveEvents,
        committed: Callable[[int], None],
        protected_steps: Callable[[], set[int]],
        on_error: Callable[[CheckpointError], None] | None = None,
    ):
        self.config = config
        self.local = local
        self.durable = durable
        self.topology = topology
        self.rank = topology.rank
        self.writer_channel = writer_channel
        self.upload_channel = upload_channel
        self.local_shared = local_shared
        self.local_ranks = None if local_shared else topology.ranks_on_my_node()
        self.is_local_leader = self.rank == 0 if local_shared else self.rank == min(topology.ranks_on_my_node())
        self.events = events
        self._on_committed = committed
        self._policy = RetryPolicy(config.upload_retries, config.upload_backoff_s)
        self._protected_steps = protected_steps
        self._on_error = on_error
        self._plan_cache_key = f"resilience-{uuid.uuid4().hex}"  # this pipeline's group (see PiecePlanner)
        self.failures = Failures()
        self._uploading: set[int] = set()
        self._client_retries = client_retries.Tally()  # answers the storage client retried on its own
        self._guard = DurableGuard(durable) if durable is not None else None
        # whose saves these are (from the save jobs: the pipeline may run in a helper): retention keeps to this
        # run's steps, and the durable tier is changed only while this job (its owner's token) holds the lease
        self._run_id: str | None = None
        self._writer: dict[str, Any] | None = None
        self._writes = Worker("resilience-writer", self._write_next)
        self._uploads = Worker("resilience-uploader", self._upload_next)
        self._peer_copies = CopySender(self._send_peer_copy)

    # ---- interface for the manager -------------------------------------------------------------------------

    def submit(self, job: WriteJob) -> None:
        self._writes.put(job)

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued work; False if it did not finish within ``timeout`` (the threads then go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = self._writes.join(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._uploads.join(left) and finished

    def retain(self) -> None:
        """Apply retention now (after the last save's names were written, say); the same as after a commit."""
        if self.is_local_leader:
            self._apply_retention(self.local, protect=self._pending_uploads())
        if self.durable is not None and self.rank == 0:
            self._apply_retention(self.durable, protect=self._pending_uploads())

    # ---- writer --------------------------------------------------------------------------------------------

    def _write_next(self, queue: list[WriteJob]) -> None:
        with self._writes.cond:
            job = queue.pop(0)
        self._write(job)

    def _write(self, job: WriteJob) -> None:
        step, handle = job.step, job.handle
        self._run_id, self._writer = job.run_id, job.writer
        local_dir = self.local.step_path(step)
        try:
            # The directory must be new (or this job's own), decided before any rank writes into it.
            self.writer_channel.agree(lambda: self._claim_dir(local_dir, job))
            gathered = self.writer_channel.agree(lambda: self._write_mine(job, local_dir))
        except Exception as exc:
            self._fail_local(job, _write_error(exc, step, local_dir))
            return
        manifest = Manifest(
            step=step,
            world_size=self.topology.world_size,
            files=[entry for entries, _ in gathered for entry in entries],
            versions=versions(),
            timings={
                "block_s": job.block_s,
                "stage_wait_s": max(t["stage_wait_s"] for _, t in gathered),
                "write_s": max(t["write_s"] for _, t in gathered),
                "hash_s": max(t["hash_s"] for _, t in gathered),
            },
            pickled=job.pickled,
            extra=job.extra,
            run_id=job.run_id,
        )
        try:
            self.writer_channel.agree(lambda: self._commit_local(local_dir, manifest))
        except Exception as exc:
            error = CheckpointError(
                f"Committing the checkpoint failed: {describe(exc)}", step=step, tier="local", path=MANIFEST
            )
            self._fail_local(job, error)
            return
        handle.timings.update(manifest.timings)
        self._on_committed(step)
        handle.committed.set_result(Commit(step, "local", local_dir, manifest.total_bytes))
        self.events.emit("local_commit", step, bytes=manifest.total_bytes, **manifest.timings)
        if self.durable is None:
            handle.durable.set_result(None)
        else:
            with self._uploads.cond:
                self._uploading.add(step)
            self._uploads.put(UploadJob(step, manifest, handle, job.peer))
        if self.is_local_leader:
            self._apply_retention(self.local, protect={step} | self._pending_uploads())

    def _claim_dir(self, local_dir: str, job: WriteJob) -> None:
        """Local leaders: make the step directory and say who writes it; refuse one that someone else writes."""
        if not self.is_local_leader:
            return
        os.makedirs(local_dir, exist_ok=True)
        try:
            with open(os.path.join(local_dir, WRITER_FILE), "x") as stream:
                json.dump(job.writer or {}, stream)
        except FileExistsError:
            raise CheckpointError(
                f"{local_dir} is being written by another process (see its {WRITER_FILE}); two jobs must not "
                "share a local_root: give this one its own",
                step=job.step,
                tier="local",
            ) from None

    def _write_mine(self, job: WriteJob, local_dir: str) -> tuple[list[FileEntry], dict[str, float]]:
        """This rank's part: DCP write of its shards, its JSON state files, checksums of what it wrote."""
        timings: dict[str, float] = {}
        try:
            t0 = time.monotonic()
            staged = job.staging.wait()
            if not job.handle.staged.done():
                job.handle.staged.set_result(None)
            timings["stage_wait_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            writer = RecordingWriter(
                local_dir,
                direct=self.config.direct_io,
                sync_files=self.config.fsync,
                thread_count=self.config.write_threads,
                overwrite=False,
            )
            dcp.save(
                staged,
                storage_writer=writer,
                planner=PiecePlanner(self._plan_cache_key),
                process_group=self.writer_channel.group,
                no_dist=not self.writer_channel.active,
            )
            timings["write_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            mine = [(name, "shard") for name in sorted(writer.written)]
            if self.rank == 0:
                mine.append((DCP_METADATA, "dcp-metadata"))
            if job.skeleton is not None:  # the leader's (the lowest rank writing)
                mine.append((STATE_FILE, "state"))
                self._write_json(local_dir, STATE_FILE, job.skeleton)
            if job.rank_skeleton is not None:
                mine.append((rank_state_file(self.rank), "state"))
                self._write_json(local_dir, rank_state_file(self.rank), job.rank_skeleton)
            entries = proofs.hashed(local_dir, self.rank, mine, writer.hashes)
            timings["hash_s"] = time.monotonic() - t0
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            log.debug("write of step %s failed on rank %s:\n%s", job.step, self.rank, traceback.format_exc())
            raise CheckpointError(describe(exc, self.rank) + space_hint(local_dir, job.staging.nbytes)) from None
        return entries, timings

    def _write_json(self, directory: str, name: str, skeleton: Any) -> None:
        self._write_bytes(directory, name, json.dumps(skeleton, allow_nan=False, separators=(",", ":")).encode())

    def _write_bytes(self, directory: str, name: str, data: bytes) -> None:
        with open(os.path.join(directory, name), "wb") as handle:
            handle.write(data)
            if self.config.fsync:
                handle.flush()
                os.fsync(handle.fileno())

    def _commit_local(self, local_dir: str, manifest: Manifest) -> None:
        if not self.is_local_leader:
            return
        if self.local_ranks is not None:  # node-local disk: this node's files only
            ranks = set(self.local_ranks)
            manifest = replace(manifest, files=[f for f in manifest.files if f.rank in ranks], ranks=sorted(ranks))
        if self.config.fsync:
            fsync_dir(local_dir)
        self.local.write_exclusive(f"{local_dir}/{MANIFEST}", manifest.to_json(), fsync=self.config.fsync)
        self.local.remove_file(f"{local_dir}/{WRITER_FILE}")

    def _fail_local(self, job: WriteJob, error: CheckpointError) -> None:
        self._record(error)
        job.handle.fail(error)
        self.events.emit("failed", job.step, tier="local", error=str(error))

    # ---- uploader ------------------------------------------------------------------------------------------

    def _pending_uploads(self) -> set[int]:
        with self._uploads.cond:
            return set(self._uploading)

    def _upload_next(self, queue: list[UploadJob]) -> None:
        with self._uploads.cond:
            newest = max(job.step for job in queue)
        try:
            # Upload the newest checkpoint every rank has ready; older queued ones are superseded.
            pick = -self.upload_channel.max([-newest])[0]
        except CheckpointError:
            pick = newest  # the group is broken: each queued upload fails on its own below
        with self._uploads.cond:
            superseded = [j for j in queue if j.step < pick]
            chosen = next((j for j in queue if j.step == pick), None)
            queue[:] = [j for j in queue if j.step > pick]
            self._uploading.difference_update(j.step for j in superseded)
        for job in superseded:
            job.handle.durable.set_result(None)
            self.events.emit("upload_skipped", job.step, reason=f"superseded by step {pick}")
        if chosen is not None:
            self._upload(chosen)
            self._report_client_retries(chosen.step)
            with self._uploads.cond:
                self._uploading.discard(chosen.step)

    def _report_client_retries(self, step: int) -> None:
        """The answers the storage client retried on its own since the last upload (throttling, mostly), as one
        event: they cost time without failing anything, so nothing else would show them."""
        count = self._client_retries.take()
        if count:
            log.info("step %d: the storage client retried %d request(s) (throttling or storage errors)", step, count)
            self.events.emit("storage_retry", step, count=count)

    def _upload(self, job: UploadJob) -> None:
        assert self.durable is not None
        step, durable = job.step, self.durable
        t0 = time.monotonic()
        client_retries.watch(durable)
        mine = [entry for entry in job.manifest.files if entry.rank == self.rank]
        try:
            self.upload_channel.decide(
                lambda: self._guarded(step, "the upload", lambda guard, writer: guard.open_step(step, writer))
            )
            self.upload_channel.agree(lambda: self._upload_files(step, mine))
        except Exception as exc:
            error = CheckpointError(f"Uploading the checkpoint failed: {_why(exc)}", step=step, tier="durable")
            self._fail_durable(job, error)
            return
        manifest = replace(job.manifest, timings={**job.manifest.timings, "upload_s": time.monotonic() - t0})

        def commit() -> None:
            self._guarded(step, "the commit", lambda guard, _: guard.check_uploaded(step, manifest))
            commit_durable(durable, step, manifest.to_json(), self._policy, self._on_retry(step))
            if self._guard is not None:
                self._guard.close_step(step)

        try:
            self.upload_channel.decide(commit)
        except Exception as exc:
            error = CheckpointError(
                f"Committing the upload failed: {_why(exc)}", step=step, tier="durable", path=MANIFEST
            )
            self._fail_durable(job, error)
            return
        upload_s = time.monotonic() - t0
        job.handle.timings["upload_s"] = upload_s
        job.handle.durable.set_result(Commit(step, "durable", durable.step_path(step), manifest.total_bytes))
        self.events.emit("durable_commit", step, bytes=manifest.total_bytes, upload_s=upload_s)
        if self.rank == 0:
            self._apply_retention(durable, protect={step})
        if job.peer is not None and manifest.run_id is not None:
            self._peer_copies.submit(job.peer, step, mine, manifest.run_id)  # never holds the next upload up

    def _send_peer_copy(self, peer: tuple[str, int], step: int, mine: list[FileEntry], run_id: str) -> None:
        """This rank's files of a durably committed step, to the partner node's memory (peer copies). A failure
        costs only speed: a lost node's files are then read from the durable tier."""
        t0 = time.monotonic()
        try:
            sent = send_copy(
                peer, rank=self.rank, run_id=run_id, step=step, directory=self.local.step_path(step), files=mine
            )
        except OSError as exc:
            log.warning("step %d: the peer copy to %s:%s failed (%s); the durable tier keeps it", step, *peer, exc)
            self.events.emit("peer_copy_failed", step, error=describe(exc))
            return
        self.events.emit("peer_copy", step, bytes=sent, seconds=time.monotonic() - t0)

    def _guarded(self, step: int, what: str, then: Guarded) -> None:
        """Rank 0, before it changes the durable tier: this job must still hold the durable URL; then ``then``
        (both retried like transfers). Without a writer (no owner: a pipeline driven by hand), nothing is checked.
        """
        if self._guard is not None and self._writer is not None:
            guarded((self._guard, self._writer), step, what, then, self._policy, self._on_retry(step))

    def _upload_files(self, step: int, entries: list[FileEntry]) -> None:
        assert self.durable is not None
        upload_files(
            self.local,
            self.durable,
            step,
            entries,
            concurrency=self.config.upload_concurrency,
            policy=self._policy,
            on_retry=self._on_retry(step),
        )

    def _on_retry(self, step: int) -> OnRetry:
        def emit(name: str, attempt: int, exc: BaseException) -> None:
            self.events.emit("upload_retry", step, file=name, attempt=attempt, error=describe(exc))

        return emit

    def _fail_durable(self, job: UploadJob, error: CheckpointError) -> None:
        # recorded before the future wakes its waiter, so the next save() is sure to see it
        if self.config.on_upload_error == "raise":
            self._record(error)
        else:
            log.warning("%s; training continues on the local tier (on_upload_error='warn')", error)
        job.handle.durable.set_exception(error)
        self.events.emit("failed", job.step, tier="durable", error=str(error))

    # ---- shared ----------------------------------------------------------------------------------------------

    def _apply_retention(self, tier: Tier, protect: set[int]) -> None:
        """Delete what the policy lets go of this run's steps (never another run's: :mod:`resilience.storage.fencing`);
        in the durable tier only while this job holds the URL, checked before each deletion."""
        run_id, writer = self._run_id, self._writer
        if run_id is None:
            return  # nothing saved through this pipeline yet: no run to keep to
        try:
            entries = scan(tier)
            healing = being_healed(tier, entries, writer.get("token")) if tier is self.durable and writer else set()
            protect = protect | set(self._protected_steps()) | healing
            doomed = steps_to_delete(
                [e.step for e in entries if e.committed],
                [e.step for e in entries if not e.committed],
                keep_last=self.config.keep_last,
                keep_every=self.config.keep_every,
                protected=protect,
                foreign=foreign_steps(tier, entries, run_id),
            )
            paths = {e.step: e.path for e in entries}
            for step in doomed:
                if tier is self.durable and self._guard is not None and writer is not None:
                    self._guard.check_held(str(writer.get("token")), f"deleting step {step}")
                remove_checkpoint(tier, paths[step])
                self.events.emit("deleted", step, tier=tier.name)
        except Exception as exc:  # retention must never fail a save
            log.warning("retention in the %s tier failed: %s", tier.name, describe(exc))

    def _record(self, error: CheckpointError) -> None:
        log.error("%s", error)
        if self._on_error is not None:
            self._on_error(error)
            return
        self.failures.add(error)


def remove_checkpoint(tier: Tier, path: str) -> None:
    """Delete a step directory, manifest first: an interrupted delete never leaves a manifest without files."""
    tier.remove_file(f"{path}/{MANIFEST}")
    tier.remove_dir(path)


def _write_error(exc: BaseException, step: int, local_dir: str) -> CheckpointError:
    return CheckpointError(f"Writing the checkpoint failed: {_why(exc)}", step=step, tier="local", path=local_dir)


def _why(exc: BaseException) -> str:
    """An error's own words when the engine raised it for a reason of its own; else its type and first line."""
    return str(exc) if type(exc) is CheckpointError else describe(exc)
