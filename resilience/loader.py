"""Reading a committed checkpoint back into a state tree, on any number of ranks.

DCP reshards: tensors given in the target (plain or DTensor) are filled in place with the part this rank
needs; tensors the target does not have are allocated whole on CPU from DCP's metadata. Everything read
from storage is checked before it is parsed: the manifest is validated JSON, ``.metadata`` must match its
checksum and is unpickled with an allow-list of DCP's own classes, shards are read by ``torch.load`` with
``weights_only=True``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from resilience.catalog import Entry
from resilience.errors import CheckpointError, CorruptCheckpointError, IncompatibleStateError, describe
from resilience.layout import DCP_METADATA, STATE_FILE, rank_state_file
from resilience.manifest import Manifest, hash_bytes
from resilience.storage import Tier
from resilience.tree import flatten, tensor_keys, unflatten


@dataclass
class Restored:
    """What :meth:`CheckpointManager.load` gives back."""

    step: int
    state: Any
    rank_state: Any
    manifest: Manifest
    tier: str
    path: str


# ---- safe reads --------------------------------------------------------------------------------------------


def read_verified(entry: Entry, name: str) -> bytes:
    """The bytes of a small file of the checkpoint, after its size and checksum match the manifest."""
    assert entry.manifest is not None
    item = entry.manifest.file(name)
    if item is None:
        raise CorruptCheckpointError(f"{entry.where()}: the manifest does not list {name}", step=entry.step)
    data = entry.tier.read_bytes(f"{entry.path}/{name}")
    if len(data) != item.size or hash_bytes(data) != item.xxh3_64:
        raise CorruptCheckpointError(
            f"{entry.where()}: {name} does not match its size/checksum in the manifest",
            step=entry.step,
            tier=entry.tier.name,
            path=name,
        )
    return data


# No BytesStorageMetadata: the engine saves tensors only, and DCP reads "bytes" entries with
# torch.load(weights_only=False), which would run a pickle from a shard.
_DCP_METADATA_CLASSES = (
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_CLASSES),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` with an exact allow-list: DCP's metadata classes, dtypes, sizes, paths.

    Anything else (a function to call, a class with side effects) is refused, so even a tampered file
    with a matching checksum cannot run code here.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def load_dcp_metadata(entry: Entry) -> Metadata:
    data = read_verified(entry, DCP_METADATA)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise CorruptCheckpointError(f"{entry.where()}: DCP metadata is not readable ({exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{entry.where()}: DCP metadata holds a {type(metadata).__name__}")
    _check_metadata(entry, metadata)
    return metadata


def _check_metadata(entry: Entry, metadata: Metadata) -> None:
    """DCP trusts its metadata to name what to read and where: hold it to what the engine writes.

    A tampered ``.metadata`` with a matching checksum could otherwise point reads at files outside the
    checkpoint (another step's shards, any file the process can read) or declare a non-tensor entry.
    """
    assert entry.manifest is not None
    shards = {item.path for item in entry.manifest.files if item.kind == "shard"}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(
                f"{entry.where()}: DCP metadata entry {key!r} is a {type(md).__name__}, not a tensor", step=entry.step
            )
    if not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{entry.where()}: DCP metadata has no map of its files", step=entry.step)
    for info in metadata.storage_data.values():
        path = getattr(info, "relative_path", None)
        if path not in shards:
            raise CorruptCheckpointError(
                f"{entry.where()}: DCP metadata points at {path!r}, which is not a shard the manifest lists",
                step=entry.step,
            )


def load_skeleton(entry: Entry, name: str) -> Any:
    data = read_verified(entry, name)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{entry.where()}: {name} is not JSON ({type(exc).__name__}: {exc})") from exc


# ---- DCP plumbing ------------------------------------------------------------------------------------------


class _TierFileSystem(FileSystemBase):
    """DCP's file-system interface, for reading only, over a tier's fsspec filesystem."""

    def __init__(self, tier: Tier):
        self.tier = tier

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise ValueError("checkpoint tiers are opened read-only while loading")
        with self.tier.open(os.fspath(path)) as stream:
            yield stream  # type: ignore[misc]

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        raise NotImplementedError

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        raise NotImplementedError

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.tier.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        raise NotImplementedError


class _VerifiedReader(FileSystemReader):
    """A FileSystemReader over a tier that hands DCP the metadata already read and checked."""

    def __init__(self, entry: Entry, metadata: Metadata):
        super().__init__(entry.path)
        self.fs = _TierFileSystem(entry.tier)  # type: ignore[assignment]
        self.path = entry.path
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


@dataclass
class LoadPlan:
    """What one rank will read: checked metadata and state files, and the tensors DCP fills."""

    metadata: Metadata
    skeleton: Any
    rank_skeleton: Any
    tensors: dict[str, torch.Tensor]


def plan_load(entry: Entry, target: Any, *, rank: int, want_rank_state: bool = True) -> LoadPlan:
    """Read and check everything small, and allocate what the target does not provide; no collectives."""
    assert entry.manifest is not None
    metadata = load_dcp_metadata(entry)
    skeleton = load_skeleton(entry, STATE_FILE)
    rank_skeleton = None
    if want_rank_state and entry.manifest.file(rank_state_file(rank)) is not None:
        rank_skeleton = load_skeleton(entry, rank_state_file(rank))

    wanted = tensor_keys(skeleton) + (tensor_keys(rank_skeleton) if rank_skeleton is not None else [])
    given = flatten(target).tensors if target is not None else {}
    missing = [key for key in given if key not in metadata.state_dict_metadata]
    if missing:
        raise IncompatibleStateError(
            f"{entry.where()} has no tensor for {len(missing)} key(s) of the target, e.g. {missing[:3]}: "
            "load into a state with the same structure as the saved one",
            step=entry.step,
        )
    tensors: dict[str, torch.Tensor] = {}
    for key in wanted:
        if key in given:
            tensors[key] = given[key]
            continue
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{entry.where()}: no tensor {key!r} in DCP metadata", step=entry.step)
        tensors[key] = torch.empty(md.size, dtype=md.properties.dtype)
    return LoadPlan(metadata, skeleton, rank_skeleton, tensors)


def run_load(entry: Entry, plan: LoadPlan, *, group: dist.ProcessGroup | None, allow_pickle: bool) -> Restored:
    """Read the shards (collective when distributed) and rebuild the trees."""
    assert entry.manifest is not None
    read_tensors(entry, plan.metadata, plan.tensors, group=group)
    where = entry.where()
    state = unflatten(plan.skeleton, plan.tensors, allow_pickle=allow_pickle, where=where)
    rank_state = None
    if plan.rank_skeleton is not None:
        rank_state = unflatten(plan.rank_skeleton, plan.tensors, allow_pickle=allow_pickle, where=where)
    return Restored(entry.step, state, rank_state, entry.manifest, entry.tier.name, entry.tier.display(entry.path))


def read_tensors(
    entry: Entry, metadata: Metadata, tensors: dict[str, torch.Tensor], *, group: dist.ProcessGroup | None = None
) -> None:
    """Fill ``tensors`` (DCP keys to targets) from the shards; collective when ``group`` is given."""
    try:
        dcp.load(
            tensors,
            storage_reader=_VerifiedReader(entry, metadata),
            process_group=group,
            no_dist=group is None,
        )
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # Storage that fails to answer may answer next time; bytes that fail to parse will fail again.
        kind = CheckpointError if _is_transient(exc) else CorruptCheckpointError
        raise kind(f"Reading {entry.where()} failed: {describe(exc)}", step=entry.step, tier=entry.tier.name) from exc


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
