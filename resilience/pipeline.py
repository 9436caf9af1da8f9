"""The background half of a save: write shards, commit locally, upload, commit durably, apply retention.

Two threads per rank, each with its own gloo group: the writer (DCP write, checksums, local manifest) and
the uploader (concurrent transfers with retries, durable manifest). Every decision that ranks must agree on
(did every rank succeed, which checkpoint to upload next) is made from an all-gather, so all ranks take the
same branch and no collective is left waiting on one side.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from resilience import __version__
from resilience.catalog import scan
from resilience.config import CheckpointConfig
from resilience.dist import Channel, Topology
from resilience.errors import CheckpointError, describe
from resilience.loader import DCP_METADATA, STATE_FILE, rank_state_file
from resilience.manifest import MANIFEST_NAME, FileEntry, Manifest, hash_stream
from resilience.retention import steps_to_delete
from resilience.staging import StagingJob
from resilience.storage import Tier, fsync_dir
from resilience.transfer import OnRetry, RetryPolicy, commit_durable, upload_files

log = logging.getLogger(__name__)
Listener = Callable[[dict[str, Any]], None]
_STOP = -1


class SaveHandle:
    """Progress of one save; returned by :meth:`CheckpointManager.save`."""

    def __init__(self, step: int, durable: bool):
        self.step = step
        self.timings: dict[str, float] = {}
        self.nbytes = 0
        self.error: BaseException | None = None
        self.durable_error: BaseException | None = None
        self._local = threading.Event()
        self._durable = threading.Event()
        self._local_ok = False
        self._durable_ok = False
        self.has_durable = durable

    @property
    def local_committed(self) -> bool:
        return self._local_ok

    @property
    def durable_committed(self) -> bool:
        return self._durable_ok

    def wait_local(self, timeout: float | None = None) -> bool:
        """Wait for the local commit; True once committed, False on timeout; raises if the save failed."""
        finished = self._local.wait(timeout)
        if self.error is not None:
            raise self.error
        return finished and self._local_ok

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait for the durable commit (False on timeout, when skipped for a newer one, or with no durable tier)."""
        if not self.has_durable:
            return self.wait_local(timeout)
        finished = self._durable.wait(timeout)
        if self.error is not None:
            raise self.error
        if self.durable_error is not None:
            raise self.durable_error
        return finished and self._durable_ok

    def _finish_local(self, error: BaseException | None) -> None:
        self.error = error
        self._local_ok = error is None
        self._local.set()
        if error is not None:
            self._durable.set()

    def _finish_durable(self, error: BaseException | None, committed: bool = True) -> None:
        self.durable_error = error
        self._durable_ok = error is None and committed
        self._durable.set()


@dataclass
class WriteJob:
    step: int
    staging: StagingJob
    skeleton: Any
    rank_skeleton: Any
    pickled: list[str]
    extra: dict[str, Any]
    handle: SaveHandle
    block_s: float


@dataclass
class UploadJob:
    step: int
    manifest: Manifest
    handle: SaveHandle


@dataclass
class _Queue:
    """A small condition-guarded list; the uploader needs to look at all queued steps, not just the head."""

    items: list[Any] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def put(self, item: Any) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()


class _RecordingWriter(FileSystemWriter):
    """FileSystemWriter that remembers which files this rank wrote, so each rank hashes only its own."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.written: set[str] = set()

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        for result in future.value():
            self.written.add(result.storage_data.relative_path)
        return future


def versions() -> dict[str, str]:
    return {
        "training-resilience": __version__,
        "torch": torch.__version__.split("+")[0],
        "python": sys.version.split()[0],
    }


class Pipeline:
    """Owns the writer and uploader threads of one rank."""

    def __init__(
        self,
        config: CheckpointConfig,
        local: Tier,
        durable: Tier | None,
        topology: Topology,
        writer_channel: Channel,
        upload_channel: Channel,
        local_shared: bool,
        listeners: list[Listener],
        committed: Callable[[int], None],
        protected_steps: Callable[[], set[int]],
    ):
        self.config = config
        self.local = local
        self.durable = durable
        self.topology = topology
        self.rank = topology.rank
        self.writer_channel = writer_channel
        self.upload_channel = upload_channel
        self.local_shared = local_shared
        self.local_ranks = None if local_shared else topology.ranks_on_my_host()
        self.is_local_leader = self.rank == 0 if local_shared else self.rank == min(topology.ranks_on_my_host())
        self.listeners = listeners
        self._on_committed = committed
        self._policy = RetryPolicy(config.upload_retries, config.upload_backoff_s)
        self._protected_steps = protected_steps
        self.errors: list[CheckpointError] = []
        self._errors_lock = threading.Lock()
        self._broken: str | None = None
        self._upload_broken: str | None = None
        self._uploading: set[int] = set()
        self._writes = _Queue()
        self._uploads = _Queue()
        self._writer = threading.Thread(target=self._write_loop, name="resilience-writer", daemon=True)
        self._uploader = threading.Thread(target=self._upload_loop, name="resilience-uploader", daemon=True)
        self._writer.start()
        if durable is not None:
            self._uploader.start()
        self._closed = False

    # ---- interface for the manager -------------------------------------------------------------------------

    def submit(self, job: WriteJob) -> None:
        self._writes.put(job)

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued work and stop the threads; False if they did not stop within ``timeout``."""
        if not self._closed:
            self._closed = True
            self._writes.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in (self._writer, self._uploader):
            if thread.is_alive():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not (self._writer.is_alive() or self._uploader.is_alive())

    def discard_error(self, error: BaseException) -> None:
        with self._errors_lock:
            self.errors = [e for e in self.errors if e is not error]

    def take_errors(self) -> list[CheckpointError]:
        with self._errors_lock:
            errors, self.errors = self.errors, []
        return errors

    # ---- writer --------------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._writes.cond:
                self._writes.cond.wait_for(lambda: bool(self._writes.items))
                job = self._writes.items.pop(0)
            if job is None:
                if self.durable is not None:
                    self._uploads.put(None)
                return
            self._write(job)

    def _write(self, job: WriteJob) -> None:
        step, handle = job.step, job.handle
        timings = {"block_s": job.block_s}
        if self._broken:
            self._fail_local(job, CheckpointError(f"Not saved: {self._broken}", step=step, tier="local"))
            return
        local_dir = self.local.step_path(step)
        entries: list[FileEntry] = []
        error: str | None = None
        try:
            t0 = time.monotonic()
            staged = job.staging.wait()
            timings["stage_wait_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            writer = _RecordingWriter(
                local_dir,
                sync_files=self.config.fsync,
                thread_count=self.config.write_threads,
                overwrite=False,
            )
            dcp.save(
                staged,
                storage_writer=writer,
                process_group=self.writer_channel.group,
                no_dist=not self.writer_channel.active,
            )
            timings["write_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            mine = [(name, "shard") for name in sorted(writer.written)]
            if self.rank == 0:
                mine.append((DCP_METADATA, "dcp-metadata"))
                mine.append((STATE_FILE, "state"))
                self._write_json(local_dir, STATE_FILE, job.skeleton)
            if job.rank_skeleton is not None:
                mine.append((rank_state_file(self.rank), "state"))
                self._write_json(local_dir, rank_state_file(self.rank), job.rank_skeleton)
            for name, kind in mine:
                with open(os.path.join(local_dir, name), "rb") as stream:
                    digest, size = hash_stream(stream)
                entries.append(FileEntry(name, size, digest, self.rank, kind))
            timings["hash_s"] = time.monotonic() - t0
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = describe(exc, self.rank) + _space_hint(local_dir, job.staging.nbytes)
            log.debug("write of step %s failed on rank %s:\n%s", step, self.rank, traceback.format_exc())
        try:
            gathered = self.writer_channel.all_gather((entries, error, timings))
        except Exception as exc:
            self._broken = f"the checkpoint group broke while saving step {step}: {describe(exc)}"
            self._fail_local(job, CheckpointError(self._broken, step=step, tier="local"))
            return
        failures = [err for _, err, _ in gathered if err]
        if failures:
            self._fail_local(
                job,
                CheckpointError(
                    f"Writing the checkpoint failed: {failures[0]}", step=step, tier="local", path=local_dir
                ),
            )
            return
        all_entries = [entry for part, _, _ in gathered for entry in part]
        timings["write_s"] = max(t.get("write_s", 0.0) for _, _, t in gathered)
        timings["hash_s"] = max(t.get("hash_s", 0.0) for _, _, t in gathered)
        manifest = Manifest(
            step=step,
            world_size=self.topology.world_size,
            files=all_entries,
            versions=versions(),
            timings=timings,
            pickled=job.pickled,
            extra=job.extra,
        )
        commit_error = None
        if self.is_local_leader:
            try:
                self._commit_local(local_dir, manifest)
            except Exception as exc:
                commit_error = describe(exc)
        try:
            commit_errors = [e for e in self.writer_channel.all_gather(commit_error) if e]
        except Exception as exc:
            self._broken = f"the checkpoint group broke while committing step {step}: {describe(exc)}"
            commit_errors = [self._broken]
        if commit_errors:
            self._fail_local(
                job,
                CheckpointError(
                    f"Committing the checkpoint failed: {commit_errors[0]}",
                    step=step,
                    tier="local",
                    path=f"{local_dir}/{MANIFEST_NAME}",
                ),
            )
            return
        handle.nbytes = manifest.total_bytes
        handle.timings.update(timings)
        handle._finish_local(None)
        self._on_committed(step)
        self._emit("local_commit", step, bytes=manifest.total_bytes, **timings)
        if self.durable is not None:
            with self._uploads.cond:
                self._uploading.add(step)
            self._uploads.put(UploadJob(step, manifest, handle))
        if self.is_local_leader:
            self._apply_retention(self.local, protect={step} | self._pending_uploads())

    def _write_json(self, directory: str, name: str, skeleton: Any) -> None:
        import json

        path = os.path.join(directory, name)
        with open(path, "w") as handle:
            json.dump(skeleton, handle, allow_nan=False, separators=(",", ":"))
            if self.config.fsync:
                handle.flush()
                os.fsync(handle.fileno())

    def _commit_local(self, local_dir: str, manifest: Manifest) -> None:
        if self.local_ranks is not None:  # node-local disk: this node's files only
            ranks = set(self.local_ranks)
            manifest = Manifest(
                **{
                    **manifest.__dict__,
                    "files": [f for f in manifest.files if f.rank in ranks],
                    "ranks": sorted(ranks),
                }
            )
        if self.config.fsync:
            fsync_dir(local_dir)
        self.local.write_exclusive(f"{local_dir}/{MANIFEST_NAME}", manifest.to_json(), fsync=self.config.fsync)

    def _fail_local(self, job: WriteJob, error: CheckpointError) -> None:
        self._record(error)
        job.handle._finish_local(error)
        self._emit("failed", job.step, tier="local", error=str(error))

    # ---- uploader ------------------------------------------------------------------------------------------

    def _pending_uploads(self) -> set[int]:
        with self._uploads.cond:
            return set(self._uploading)

    def _upload_loop(self) -> None:
        while True:
            with self._uploads.cond:
                self._uploads.cond.wait_for(lambda: bool(self._uploads.items))
                steps = [job.step for job in self._uploads.items if job is not None]
                newest = max(steps) if steps else _STOP
            if self._upload_broken is None:
                try:
                    # Upload the newest checkpoint every rank has ready; older queued ones are superseded.
                    pick = -self.upload_channel.max([-newest])[0]
                except Exception as exc:
                    self._upload_broken = f"the upload group broke: {describe(exc)}"
                    pick = newest
            else:
                pick = newest
            with self._uploads.cond:
                superseded = [j for j in self._uploads.items if j is not None and j.step < pick]
                chosen = next((j for j in self._uploads.items if j is not None and j.step == pick), None)
                self._uploads.items = [j for j in self._uploads.items if j is None or j.step > pick]
                self._uploading.difference_update(j.step for j in superseded)
            for job in superseded:
                job.handle._finish_durable(None, committed=False)
                self._emit("upload_skipped", job.step, reason=f"superseded by step {pick}")
            if pick == _STOP:
                return
            if chosen is not None:
                self._upload(chosen)
                with self._uploads.cond:
                    self._uploading.discard(chosen.step)

    def _upload(self, job: UploadJob) -> None:
        assert self.durable is not None
        step, durable = job.step, self.durable
        if self._upload_broken:
            self._fail_durable(job, CheckpointError(f"Not uploaded: {self._upload_broken}", step=step, tier="durable"))
            return
        t0 = time.monotonic()
        error: str | None = None
        mine = [entry for entry in job.manifest.files if entry.rank == self.rank]
        try:
            self._upload_files(step, mine)
        except Exception as exc:
            error = describe(exc, self.rank)
        try:
            failures = [e for e in self.upload_channel.all_gather(error) if e]
            commit_error = None
            if not failures and self.rank == 0:
                manifest = Manifest(
                    **{
                        **job.manifest.__dict__,
                        "timings": {**job.manifest.timings, "upload_s": time.monotonic() - t0},
                    }
                )
                try:
                    commit_durable(self.durable, step, manifest.to_json(), self._policy, self._on_retry(step))
                except Exception as exc:
                    commit_error = describe(exc)
            if not failures:
                commit_error = self.upload_channel.broadcast(commit_error)
        except Exception as exc:
            self._upload_broken = f"the upload group broke while uploading step {step}: {describe(exc)}"
            self._fail_durable(job, CheckpointError(self._upload_broken, step=step, tier="durable"))
            return
        if failures:
            self._fail_durable(
                job,
                CheckpointError(f"Uploading the checkpoint failed: {failures[0]}", step=step, tier="durable"),
            )
            return
        if commit_error:
            self._fail_durable(
                job,
                CheckpointError(
                    f"Committing the upload failed: {commit_error}",
                    step=step,
                    tier="durable",
                    path=MANIFEST_NAME,
                ),
            )
            return
        upload_s = time.monotonic() - t0
        job.handle.timings["upload_s"] = upload_s
        job.handle._finish_durable(None)
        self._emit("durable_commit", step, bytes=job.manifest.total_bytes, upload_s=upload_s)
        if self.rank == 0:
            self._apply_retention(durable, protect={step})

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
            self._emit("upload_retry", step, file=name, attempt=attempt, error=describe(exc))

        return emit

    def _fail_durable(self, job: UploadJob, error: CheckpointError) -> None:
        # recorded before the handle wakes its waiter, so the next save() is sure to see it
        if self.config.on_upload_error == "raise":
            self._record(error)
        else:
            log.warning("%s; training continues on the local tier (on_upload_error='warn')", error)
        job.handle._finish_durable(error)
        self._emit("failed", job.step, tier="durable", error=str(error))

    # ---- shared ----------------------------------------------------------------------------------------------

    def _apply_retention(self, tier: Tier, protect: set[int]) -> None:
        try:
            protect = protect | set(self._protected_steps())
            entries = scan(tier)
            doomed = steps_to_delete(
                [e.step for e in entries if e.committed],
                [e.step for e in entries if not e.committed],
                keep_last=self.config.keep_last,
                keep_every=self.config.keep_every,
                protected=protect,
            )
            paths = {e.step: e.path for e in entries}
            for step in doomed:
                remove_checkpoint(tier, paths[step])
                self._emit("deleted", step, tier=tier.name)
        except Exception as exc:  # retention must never fail a save
            log.warning("retention in the %s tier failed: %s", tier.name, describe(exc))

    def _record(self, error: CheckpointError) -> None:
        log.error("%s", error)
        with self._errors_lock:
            self.errors.append(error)

    def _emit(self, event: str, step: int, **fields: Any) -> None:
        record = {"event": event, "step": step, "rank": self.rank, "time": time.time(), **fields}
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:  # a broken listener must not break checkpointing
                log.exception("checkpoint listener failed on %s", event)


def remove_checkpoint(tier: Tier, path: str) -> None:
    """Delete a step directory, manifest first: an interrupted delete never leaves a manifest without files."""
    manifest = f"{path}/{MANIFEST_NAME}"
    if tier.exists(manifest):
        tier.fs.rm_file(manifest)
    tier.remove_dir(path)


def _space_hint(directory: str, need: int) -> str:
    """Name a full disk: ENOSPC inside ``torch.save`` surfaces only as its zip writer's "unexpected pos" error."""
    try:
        free = shutil.disk_usage(directory if os.path.isdir(directory) else os.path.dirname(directory)).free
    except OSError:
        return ""
    if free >= need:
        return ""
    return f"; only {free} bytes are free under {directory}, less than the {need} bytes to write: the disk is full"
