"""Reading a committed checkpoint back into a state tree, on any number of ranks.

DCP reshards: tensors given in the target (plain or DTensor) are filled in place with the part this rank
needs; tensors the target does not have are read whole on CPU (DCP's metadata gives their shapes), each
taken as ``torch.load`` made it rather than copied once more into memory allocated for it. Everything read
from storage is checked before it is parsed: the manifest is validated JSON, the small files are read by
:mod:`resilience.checkpoint.safe_reads` (``.metadata`` unpickled with an allow-list of DCP's own classes), shards
are read by ``torch.load`` with ``weights_only=True``, through :class:`~resilience.storage.dcp_fs.LoadFileSystem`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner import LoadPlan as DcpLoadPlan
from torch.futures import Future

from resilience import leaving
from resilience.checkpoint import packing
from resilience.checkpoint.hashed_read import Wanted, aligned_bytes, read_hashed, read_whole
from resilience.checkpoint.packing import PackIndex
from resilience.checkpoint.safe_reads import load_dcp_metadata, load_packs, load_skeleton
from resilience.checkpoint.tree import TAG, flatten, tensor_keys, unflatten
from resilience.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleStateError,
    ReadInterruptedError,
    UncheckedReadError,
    causes,
    describe,
    interruption,
)
from resilience.persist.direct_io import THROUGH_BYTES, Window
from resilience.persist.record_layout import stored_record
from resilience.storage.catalog import Entry, check_hashed
from resilience.storage.dcp_fs import HASHED_AS_READ, LoadFileSystem, ReadCounter
from resilience.storage.layout import STATE_FILE, rank_state_file
from resilience.storage.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass
class Restored:
    """What :meth:`CheckpointManager.load` gives back."""

    step: int
    state: Any
    rank_state: Any
    manifest: Manifest
    tier: str
    path: str
    timings: dict[str, float] = field(default_factory=dict)  # the load's parts (CheckpointManager.load)


# ---- reading the shards ------------------------------------------------------------------------------------


class _VerifiedReader(FileSystemReader):
    """A FileSystemReader over a tier that hands DCP the metadata already read and checked.

    ``adoptable``: keys whose target the loader allocated itself (nothing of the caller's is filled in place).
    DCP reads each tensor with ``torch.load`` into new memory and then copies it into the target; for these
    keys the tensor read becomes the target instead (:attr:`adopted`), so a resume allocates and writes its
    state once, not twice (on this project's 2-core VM, first touching fresh memory costs about 0.7 s per GB).
    """

    def __init__(
        self,
        entry: Entry,
        metadata: Metadata,
        check_reads: bool,
        adoptable: dict[str, torch.Tensor] | None = None,
        read: ReadCounter | None = None,
    ):
        super().__init__(entry.path)
        self.files = LoadFileSystem(entry, check=check_reads, read=read)
        self.fs = self.files  # type: ignore[assignment]
        self.path = entry.path
        self._metadata = metadata
        self.adoptable = adoptable or {}
        self.adopted: dict[str, torch.Tensor] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: DcpLoadPlan, planner: LoadPlanner) -> Future[None]:
        items = [(req, self.storage_data[req.storage_index]) for req in plan.items]
        if not self.adoptable or any(info.transform_descriptors for _, info in items):
            return super().read_data(plan, planner)  # DCP's own loop (stream transforms are its business)
        per_file: dict[str, list[tuple[ReadItem, Any]]] = {}
        for req, info in items:
            if req.type != LoadItemType.TENSOR:  # the metadata check lets none through; never parse one
                raise CorruptCheckpointError(f"{self.path}: {req.dest_index.fqn!r} is not a tensor entry")
            per_file.setdefault(info.relative_path, []).append((req, info))
        for relative_path, reqs in per_file.items():
            reqs.sort(key=lambda pair: pair[1].offset)  # one pass through the file
            self._read_file(self.fs.concat_path(self.path, relative_path), reqs, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, path: str | os.PathLike[str], reqs: list[tuple[ReadItem, Any]], planner: LoadPlanner) -> None:
        """One file's entries. A file this load must check, whose every tensor becomes memory of the loader's own,
        is read once, in order, and hashed as it is (:mod:`~resilience.checkpoint.hashed_read`); any other is read
        where each entry lies, once :class:`LoadFileSystem` has checked it if need be."""
        wanted = [
            Wanted(info.offset, info.length, like) for req, info in reqs if (like := self._whole(req)) is not None
        ]
        item = self.files.due(path)
        if item is None or len(wanted) < len(reqs):  # nothing to check, or a caller's tensor (or a piece) to fill
            with self.files.create_stream(path, "rb") as stream:
                self._read_each(stream, reqs, planner)  # type: ignore[arg-type]
            return
        with self.files.create_stream(path, HASHED_AS_READ) as stream:
            loaded = read_hashed(stream, item, wanted, partial(check_hashed, self.files.entry, item))  # type: ignore[arg-type]
        for (req, _), tensor in zip(reqs, loaded, strict=True):
            self._take(req, tensor, planner)

    def _whole(self, req: ReadItem) -> torch.Tensor | None:
        """The loader's own placeholder when ``req`` reads its tensor whole, to become what is read (None: a
        piece of a tensor, or a caller's tensor, filled in place)."""
        if any(req.dest_offsets) or any(req.storage_offsets):
            return None
        return self.adoptable.get(req.dest_index.fqn)

    def _read_each(self, stream: IO[bytes], reqs: list[tuple[ReadItem, Any]], planner: LoadPlanner) -> None:
        """Each entry read where it lies (its file already checked, or not to be), and put in place at once."""
        for req, info in reqs:
            whole = self._whole(req)
            loaded = _read_in_place(stream, info.offset, info.length, whole) if whole is not None else None
            if loaded is None:
                stream.seek(info.offset)
                loaded = torch.load(Window(stream, info.length), map_location="cpu", weights_only=True)  # type: ignore[arg-type]
            self._take(req, loaded, planner)

    def _take(self, req: ReadItem, loaded: torch.Tensor, planner: LoadPlanner) -> None:
        """The tensor read for ``req`` becomes its target (:attr:`adopted`), or is copied into it."""
        whole = self._whole(req)
        key = req.dest_index.fqn
        if (
            whole is not None
            and tuple(req.lengths) == tuple(whole.shape) == tuple(loaded.shape)
            and loaded.dtype == whole.dtype
        ):
            self.adopted[key] = loaded
            return
        piece = loaded
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            piece = piece.narrow(dim, start, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != piece.size():
            raise CorruptCheckpointError(
                f"{self.path}: {key!r} holds {list(piece.size())} where {list(target.size())} is read"
            )
        target.copy_(piece)
        planner.commit_tensor(req, target)


def _read_in_place(stream: IO[bytes], offset: int, length: int, like: torch.Tensor) -> torch.Tensor | None:
    """The tensor of the DCP entry of ``length`` bytes at ``offset``, shaped and typed as ``like``, its bytes read
    from its record straight into memory of its own that starts on a block; None for a small tensor, or an entry
    whose record does not hold exactly the tensor's bytes (``torch.load`` reads it then).

    ``torch.load`` allocates where its allocator likes, so past the page cache the bytes land in an aligned buffer
    first and are copied from there (on this project's 2-core VM, 1.6 GB read in 3.5 s that way and in 1.6 s
    straight). The record's place comes from its pickle, read with an allow-list that builds nothing
    (:mod:`resilience.persist.record_layout`)."""
    if like.nbytes < THROUGH_BYTES:
        return None
    found = stored_record(stream, offset, length, tuple(like.shape), like.dtype)
    if found is None:
        return None
    start, nbytes, _ = found
    memory, view = aligned_bytes(nbytes)
    stream.seek(start)
    read_whole(stream, view)
    return memory.view(like.dtype).view(like.shape)


@dataclass
class LoadPlan:
    """What one rank will read: checked metadata and state files, and the tensors DCP fills."""

    metadata: Metadata
    skeleton: Any
    rank_skeleton: Any
    tensors: dict[str, torch.Tensor]
    layout: PackIndex | None = None
    packed: list[str] = field(default_factory=list)  # keys read out of packs after DCP has filled them
    pack_targets: dict[str, torch.Tensor] = field(default_factory=dict)
    allocated: set[str] = field(default_factory=set)  # keys of tensors made here, not given by the caller


def plan_load(
    entry: Entry, target: Any, *, rank: int, want_rank_state: bool = True, leave_out: Collection[str] = ()
) -> LoadPlan:
    """Read and check everything small, and allocate what the target does not provide; no collectives.

    ``leave_out``: top-level keys of the shared state not to read at all (an evaluation needs no optimizer
    state, and allocating it whole on every rank could exceed memory that holds only a shard of it).
    """
    assert entry.manifest is not None
    metadata = load_dcp_metadata(entry)
    skeleton = load_skeleton(entry, STATE_FILE)
    if leave_out and isinstance(skeleton, dict) and TAG not in skeleton:
        skeleton = {key: value for key, value in skeleton.items() if key not in leave_out}
    rank_skeleton = None
    if want_rank_state and entry.manifest.file(rank_state_file(rank)) is not None:
        rank_skeleton = load_skeleton(entry, rank_state_file(rank))
    layout = load_packs(entry, metadata)
    slots = layout.slots if layout is not None else {}

    wanted = tensor_keys(skeleton) + (tensor_keys(rank_skeleton) if rank_skeleton is not None else [])
    wanted = list(dict.fromkeys(wanted))  # a tensor the state refers to twice (tied weights) is read once
    given = flatten(target).tensors if target is not None else {}
    missing = [key for key in given if key not in metadata.state_dict_metadata and key not in slots]
    if missing:
        raise IncompatibleStateError(
            f"{entry.where()} has no tensor for {len(missing)} key(s) of the target, e.g. {missing[:3]}: "
            "load into a state with the same structure as the saved one",
            step=entry.step,
        )
    plan = LoadPlan(metadata, skeleton, rank_skeleton, {}, layout)
    for key in wanted:
        slot = slots.get(key)
        if slot is not None:
            if key in given:
                _check_shape(entry, key, slot.shape, given[key])
                plan.pack_targets[key] = given[key]
            if slot.pack not in plan.tensors:
                assert layout is not None
                plan.tensors[slot.pack] = torch.empty(layout.sizes[slot.pack], dtype=torch.uint8)
                plan.allocated.add(slot.pack)
            plan.packed.append(key)
            continue
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{entry.where()}: no tensor {key!r} in DCP metadata", step=entry.step)
        if key in given:
            _check_shape(entry, key, tuple(md.size), given[key])
            plan.tensors[key] = given[key]
        else:
            plan.tensors[key] = torch.empty(md.size, dtype=md.properties.dtype)  # untouched unless copied into
            plan.allocated.add(key)
    return plan


def _check_shape(entry: Entry, key: str, saved: tuple[int, ...], target: torch.Tensor) -> None:
    """A target must have the saved tensor's shape (a DTensor its global one; dtypes convert, as in DCP): a
    mismatch is the caller's, and must not set a sound checkpoint aside as DCP's failed read would."""
    if tuple(target.shape) != tuple(saved):
        raise IncompatibleStateError(
            f"{entry.where()}: tensor {key!r} was saved with shape {list(saved)}, the target's is "
            f"{list(target.shape)}: load into a state with the same structure as the saved one",
            step=entry.step,
        )


def run_load(
    entry: Entry,
    plan: LoadPlan,
    *,
    group: dist.ProcessGroup | None,
    allow_pickle: bool,
    check_reads: bool = False,
    read: ReadCounter | None = None,
) -> Restored:
    """Read the shards (collective when distributed) and rebuild the trees.

    Files held nearer than the entry's tier (``entry.near``: this node's disk, a peer's memory) are read there.
    ``check_reads``: shards were not hashed before the load; each is checked as it is read
    (:class:`~resilience.storage.dcp_fs.LoadFileSystem`). ``read`` counts the bytes read as they come.
    """
    assert entry.manifest is not None
    read_tensors(
        entry,
        plan.metadata,
        plan.tensors,
        group=group,
        check_reads=check_reads,
        adopt=plan.allocated,
        read=read,
    )
    tensors = plan.tensors
    if plan.layout is not None and plan.packed:
        unpacked = packing.unpack(plan.layout, plan.packed, plan.tensors, plan.pack_targets)
        tensors = {key: t for key, t in plan.tensors.items() if key not in plan.layout.sizes} | unpacked
    where = entry.where()
    if entry.near is not None and (nearer := entry.near.describe()) is not None:
        log.info("%s: %s", where, nearer)
    state = unflatten(plan.skeleton, tensors, allow_pickle=allow_pickle, where=where)
    rank_state = None
    if plan.rank_skeleton is not None:
        rank_state = unflatten(plan.rank_skeleton, tensors, allow_pickle=allow_pickle, where=where)
    return Restored(entry.step, state, rank_state, entry.manifest, entry.tier.name, entry.tier.display(entry.path))


def read_tensors(
    entry: Entry,
    metadata: Metadata,
    tensors: dict[str, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    check_reads: bool = False,
    adopt: Collection[str] = (),
    read: ReadCounter | None = None,
) -> None:
    """Fill ``tensors`` (DCP keys to targets) from the shards; collective when ``group`` is given. The targets of
    the keys in ``adopt`` may be replaced by the tensors read instead."""
    reader = _VerifiedReader(entry, metadata, check_reads, {key: tensors[key] for key in adopt}, read)
    try:
        dcp.load(tensors, storage_reader=reader, process_group=group, no_dist=group is None)
        tensors.update(reader.adopted)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        raise read_failure(exc, entry, dist.get_rank(group) if group is not None else 0) from exc


def read_failure(exc: BaseException, entry: Entry, rank: int) -> BaseException:
    """What a failed read of ``entry`` is taken for. Only evidence sets a copy aside, so the kinds are:

    - a stop (a signal handler's ``SystemExit``, Ctrl-C) on this rank, or a read that failed after this process
      decided to leave (:mod:`resilience.leaving`): the stop, so the process leaves as the handler meant it to; a
      stop on another rank: :class:`ReadInterruptedError`. Either way the copy stays.
    - a file whose checksum or size does not match its manifest, found as it was read: corrupt.
    - storage that failed to answer (a connection, a timeout, EINTR): not the bytes' fault, may work next time.
    - anything else (a parse error of bytes nobody hashed, a bug): :class:`UncheckedReadError`, the copy is checked
      against its manifest before anything is decided (:meth:`Restorer.load`).
    """
    where = f"Reading {entry.where()} failed"
    if (code := leaving.decided()) is not None:  # a stop whose SystemExit DCP swallowed, here or on another rank
        return SystemExit(code)
    stop = interruption(exc)
    if stop is not None:
        stopped_rank, stopped = stop
        if stopped_rank in (None, rank):
            return stopped
        return ReadInterruptedError(f"{where}: rank {stopped_rank} was stopped ({describe(stopped)})", step=entry.step)
    kind: type[CheckpointError]
    if any(isinstance(cause, CorruptCheckpointError) for _, cause in causes(exc)):
        kind = CorruptCheckpointError
    elif _is_transient(exc):
        kind = CheckpointError
    else:
        kind = UncheckedReadError
    return kind(f"{where}: {describe(exc)}", step=entry.step, tier=entry.tier.name)


def _is_transient(exc: BaseException) -> bool:
    """Whether a failed read is the storage's fault (connection, timeout) rather than the bytes'."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        return all(_is_transient(inner) for inner, _ in failures.values())
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return isinstance(cause, (ConnectionError, TimeoutError)) or (
        isinstance(cause, OSError) and not isinstance(cause, (FileNotFoundError, IsADirectoryError))
    )
