"""Survivor saves: when ranks die or hang, the healthy ones commit what their replicas hold, without them.

A dead or hung rank breaks every collective it belongs to, the checkpoint groups included, so the survivors'
save uses none: each survivor writes its share with DCP in this process alone (its own file prefix and
metadata file), and they coordinate through small files in the shared local tier. The lowest surviving rank
coordinates: it waits until every survivor is ready (their helper processes stopped), clears a save that
was cut short, names the survivors in a plan, merges the survivors' DCP metadata into one, checks that every
tensor is whole (an FSDP shard that lived only on a lost rank makes it stand down), and commits the manifest,
which records who wrote it. The lost ranks' own state (RNG streams, data position) comes from the boundary
state they last published (:mod:`resilience.recovery.liveness`), so a resume on the full world size is exact.

Requires a local tier every rank sees (one host, or a shared file system).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from resilience.checkpoint.deal import SaveTree
from resilience.checkpoint.safe_reads import MetadataUnpickler
from resilience.checkpoint.staging import HostStager
from resilience.checkpoint.tree import flatten
from resilience.errors import CheckpointError, describe
from resilience.persist.pipeline import PiecePlanner, RecordingWriter, versions
from resilience.persist.transfer import RetryPolicy, commit_durable, upload_files
from resilience.storage import proofs
from resilience.storage.fencing import DurableGuard
from resilience.storage.layout import DCP_METADATA, MANIFEST, STATE_FILE, rank_prefix, rank_state_file
from resilience.storage.manifest import FileEntry, Manifest, hash_stream
from resilience.storage.tiers import fsync_dir

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager
    from resilience.recovery.liveness import Liveness
    from resilience.session import SaveState

log = logging.getLogger(__name__)
SURVIVORS_DIR = ".survivors"
_POLL_S = 0.05


@dataclass
class SurvivorOutcome:
    """What a survivor save came to (the same on every survivor, once it returns)."""

    step: int
    committed: bool
    saved_by: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    reason: str | None = None
    seconds: float = 0.0

    def describe(self) -> str:
        return f"survivor save of step {self.step} " + (
            "committed" if self.committed else f"not committed ({self.reason})"
        )


def missing_chunks(metadata: Metadata) -> list[str]:
    """Tensors whose chunks do not cover them: their missing part lived only on a rank that wrote nothing."""
    missing = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            covered = sum(int(torch.Size(chunk.sizes).numel()) for chunk in md.chunks)
            if covered < int(md.size.numel()):
                missing.append(key)
    return missing


def missing_entries(metadata: Metadata, needed: list[str]) -> list[str]:
    """What keeps ``metadata`` from holding the whole state: tensors with missing chunks, and ``needed`` DCP keys
    that no survivor wrote, such as a DTensor held only on the lost part of its mesh."""
    return missing_chunks(metadata) + [key for key in needed if key not in metadata.state_dict_metadata]


@dataclass
class _Share:
    """What a survivor's write was planned from: the fingerprint of the deal, and the DCP keys the shared state
    needs."""

    digest: int
    needed: list[str]


class _SoloWriter(RecordingWriter):
    """One survivor's DCP write, no collectives: files ``__<rank>_<i>.distcp`` and metadata ``__<rank>.metadata``."""

    def __init__(self, path: str, rank: int, **kwargs: Any):
        super().__init__(path, overwrite=True, **kwargs)
        self._solo_rank = rank

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, rank=self._solo_rank, use_collectives=False)


class _Board:
    """The survivors' notice board: one JSON file per note, written whole (tmp + rename)."""

    def __init__(self, folder: str, deadline: float):
        self.folder = folder
        self.deadline = deadline
        os.makedirs(folder, exist_ok=True)

    def post(self, name: str, body: Any) -> None:
        path = os.path.join(self.folder, f"{name}.json")
        with open(path + ".tmp", "w") as stream:
            json.dump(body, stream)
        os.replace(path + ".tmp", path)

    def wait(self, name: str) -> Any:
        path = os.path.join(self.folder, f"{name}.json")
        while True:
            with contextlib.suppress(FileNotFoundError, ValueError), open(path) as stream:
                return json.load(stream)
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"no {name!r} from the other survivors in time")
            time.sleep(_POLL_S)

    def wait_all(self, prefix: str, ranks: list[int]) -> dict[int, Any]:
        return {rank: self.wait(f"{prefix}-{rank}") for rank in ranks}


def survivor_save(
    manager: CheckpointManager,
    *,
    step: int,
    meeting: int,
    shared: SaveState,
    rank_state: Any,
    lost: set[int],
    liveness: Liveness,
    timeout_s: float,
) -> SurvivorOutcome:
    """Commit ``step`` from the survivors (every rank not in ``lost``); call on every survivor.

    ``shared``: the state all ranks share (its tensors as of ``step``: live ones, if no optimizer step ran
    since); ``rank_state``: this rank's own, as captured at the boundary after ``step``; ``meeting``: the step the
    rescue notice names, where the survivors meet: one at another step makes them stand down.
    Never raises for a failed save: the outcome says why (the caller is on its way out either way).
    """
    start = time.monotonic()
    rank, world = manager.rank, manager.world_size
    survivors = sorted(set(range(world)) - lost)
    outcome = SurvivorOutcome(step, False, survivors, sorted(lost))
    if rank not in survivors:
        outcome.reason = "this rank is among the lost"
        return outcome
    board = _Board(
        os.path.join(manager.local.root, SURVIVORS_DIR, manager.job_token, f"step-{meeting}"), start + timeout_s
    )
    coordinator = survivors[0]
    try:
        manager.stop_background()  # our helper may be stuck in a collective with the lost rank: it goes first
        board.post(f"ready-{rank}", {"step": step, "lost": sorted(lost)})
        if rank == coordinator:
            board.post("plan", _plan(manager, board, meeting, survivors))
        plan = board.wait("plan")
        if not plan["go"]:
            outcome.reason = plan["reason"]
            return _done(outcome, start)
        entries, share = _write_share(manager, step, shared, rank_state, lost, liveness)
        board.post(f"files-{rank}", {"files": [entry.__dict__ for entry in entries], "deal": share.digest})
        if rank == coordinator:
            board.post("done", _commit(manager, board, step, shared, survivors, lost, share))
        done = board.wait("done")
        outcome.committed, outcome.reason = bool(done["committed"]), done.get("reason")
    except Exception as exc:
        outcome.reason = describe(exc)
    return _done(outcome, start)


def _done(outcome: SurvivorOutcome, start: float) -> SurvivorOutcome:
    outcome.seconds = time.monotonic() - start
    level = logging.WARNING if outcome.committed else logging.ERROR
    log.log(
        level,
        "survivor save of step %d by ranks %s (lost: %s): %s after %.1f s",
        outcome.step,
        outcome.saved_by,
        outcome.lost,
        "committed" if outcome.committed else f"not committed ({outcome.reason})",
        outcome.seconds,
    )
    return outcome


def _plan(manager: CheckpointManager, board: _Board, step: int, survivors: list[int]) -> dict[str, Any]:
    """The coordinator: every survivor ready at the same step, and the step not committed yet."""
    readies = board.wait_all("ready", survivors)
    steps = sorted({int(body["step"]) for body in readies.values()})
    if steps != [step]:
        return {"go": False, "reason": f"the survivors stopped at different steps {steps}"}
    step_dir = manager.local.step_path(step)
    if manager.local.exists(f"{step_dir}/{MANIFEST}"):
        return {"go": False, "reason": f"step {step} is committed already"}
    manager.local.remove_dir(step_dir)  # a save of this step that the failure cut short
    return {"go": True}


def _write_share(
    manager: CheckpointManager,
    step: int,
    shared: SaveState,
    rank_state: Any,
    lost: set[int],
    liveness: Liveness,
) -> tuple[list[FileEntry], _Share]:
    """This survivor's files (and, for the coordinator, the lost ranks' own state); returns them, hashed, and what
    the coordinator checks the merged metadata against."""
    rank = manager.rank
    step_dir = manager.local.step_path(step)
    # An ordinary save's deal, with the lost ranks as abstaining writers: the survivors' shares cover the state.
    tree = SaveTree.of(shared.state, manager.world_size, lost, shared.replicated)
    share = tree.share(rank, rank_state, None)
    tensors = dict(share.tensors)
    skeletons: dict[str, Any] = {}
    if share.rank_flat is not None:
        skeletons[rank_state_file(rank)] = share.rank_flat.skeleton
    if share.skeleton is not None:  # the leader: the skeleton, and the lost ranks' own state
        skeletons[STATE_FILE] = share.skeleton
        for other in sorted(lost):
            found = liveness.boundary_state(other)
            if found is not None and found[0] == step:
                theirs = flatten(found[1], prefix=rank_prefix(other))
                tensors.update(theirs.tensors)
                skeletons[rank_state_file(other)] = theirs.skeleton
            else:
                log.warning("rank %d left no state of step %d: its RNG and data position start afresh", other, step)
    stager = HostStager(pin_memory=False)
    staged = stager.stage(tensors).wait()  # a copy off the device; the training thread is stopped
    os.makedirs(step_dir, exist_ok=True)
    # Buffered, whatever direct_io says: a restart in place reads this save back at once, from the page cache.
    writer = _SoloWriter(step_dir, rank, sync_files=manager.config.fsync)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "existing checkpoint": other survivors' files in the same folder
        dcp.save(staged, storage_writer=writer, planner=PiecePlanner(), no_dist=True)
    stager.close()
    names = [(name, "shard") for name in sorted(writer.written)] + [(f"__{rank}{DCP_METADATA}", "dcp-metadata")]
    for name, skeleton in skeletons.items():
        with open(os.path.join(step_dir, name), "w") as stream:
            json.dump(skeleton, stream, allow_nan=False, separators=(",", ":"))
        names.append((name, "state"))
    return proofs.hashed(step_dir, rank, names, writer.hashes), _Share(tree.digest, list(tree.flat.tensors))


def _commit(
    manager: CheckpointManager,
    board: _Board,
    step: int,
    shared: SaveState,
    survivors: list[int],
    lost: set[int],
    share: _Share,
) -> dict[str, Any]:
    """The coordinator: one DCP metadata from the survivors' own, every tensor whole, then the manifest."""
    posts = board.wait_all("files", survivors)
    step_dir = manager.local.step_path(step)
    if any(posts[rank]["deal"] != share.digest for rank in survivors):
        manager.local.remove_dir(step_dir)
        return {
            "committed": False,
            "reason": "the survivors' shared states differ in their tensors, so their shares would not cover the state",
        }
    entries = [FileEntry(**item) for rank in survivors for item in posts[rank]["files"]]
    parts = [e for e in entries if e.kind == "dcp-metadata"]
    merged = _merge([_read_metadata(os.path.join(step_dir, part.path)) for part in parts])
    missing = missing_entries(merged, share.needed)
    if missing:
        manager.local.remove_dir(step_dir)
        return {
            "committed": False,
            "reason": (
                f"{len(missing)} tensor(s), e.g. {missing[0]!r}, had parts only the lost rank(s) {sorted(lost)} held "
                "(sharded state with no replica), or no survivor wrote them: nothing saved, the resume uses the last "
                "commit"
            ),
        }
    with open(os.path.join(step_dir, DCP_METADATA), "wb") as stream:
        pickle.dump(merged, stream)
    for part in parts:
        os.unlink(os.path.join(step_dir, part.path))
    with open(os.path.join(step_dir, DCP_METADATA), "rb") as stream:
        digest, size = hash_stream(stream)
    files = [e for e in entries if e.kind != "dcp-metadata"] + [
        FileEntry(DCP_METADATA, size, digest, survivors[0], "dcp-metadata")
    ]
    manifest = Manifest(
        step=step,
        world_size=manager.world_size,
        files=files,
        versions=versions(),
        extra={**shared.extra, "survivor_save": {"saved_by": survivors, "lost": sorted(lost)}},
        run_id=manager.run_id,
    )
    if manager.config.fsync:
        fsync_dir(step_dir)
    manager.local.write_exclusive(f"{step_dir}/{MANIFEST}", manifest.to_json(), fsync=manager.config.fsync)
    if manager.durable is not None and manager.owner is not None and manager.lease_token is not None:
        with contextlib.suppress(Exception):  # the local commit stands; a relaunch can upload it
            policy = RetryPolicy(manager.config.upload_retries, manager.config.upload_backoff_s)
            guard, token = DurableGuard(manager.durable), manager.lease_token  # only while this job holds the URL
            guard.open_step(step, {**manager.owner.to_json(), "token": token})
            upload_files(
                manager.local,
                manager.durable,
                step,
                files,
                concurrency=manager.config.upload_concurrency,
                policy=policy,
            )
            guard.check_held(token, f"the commit of step {step}")
            guard.check_uploaded(step, manifest)
            commit_durable(manager.durable, step, manifest.to_json(), policy)
            guard.close_step(step)
    return {"committed": True}


def _read_metadata(path: str) -> Metadata:
    with open(path, "rb") as stream:
        metadata = MetadataUnpickler(io.BytesIO(stream.read())).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def _merge(parts: list[Metadata]) -> Metadata:
    """The survivors' metadata as one: each tensor's chunks together, each chunk once."""
    merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
    for part in parts:
        for key, md in part.state_dict_metadata.items():
            known = merged.state_dict_metadata.get(key)
            if known is None:
                merged.state_dict_metadata[key] = md
            elif isinstance(known, TensorStorageMetadata) and isinstance(md, TensorStorageMetadata):
                offsets = {tuple(c.offsets) for c in known.chunks}
                known.chunks.extend(c for c in md.chunks if tuple(c.offsets) not in offsets)
        if isinstance(part.planner_data, dict):
            merged.planner_data.update(part.planner_data)
        if isinstance(part.storage_data, dict):
            for index, info in part.storage_data.items():
                merged.storage_data.setdefault(index, info)
    merged.version = parts[0].version if parts else None
    return merged
