"""The small files of a checkpoint, read safely: each is checked against its manifest entry before it is parsed.

``.metadata`` is unpickled with an allow-list of DCP's own classes and held to what the engine writes (tensor
entries only, in shards the manifest lists), so a tampered file with a matching checksum can neither run code nor
point a load at other files; the JSON state files and ``packs.json`` must be valid JSON of their kind.
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from resilience.checkpoint.packing import PackIndex
from resilience.errors import CorruptCheckpointError
from resilience.storage.catalog import Entry
from resilience.storage.layout import DCP_METADATA, PACKS_FILE
from resilience.storage.manifest import hash_bytes


def read_verified(entry: Entry, name: str) -> bytes:
    """The bytes of a small file of the checkpoint, after its size and checksum match the manifest."""
    assert entry.manifest is not None
    item = entry.manifest.file(name)
    if item is None:
        raise CorruptCheckpointError(f"{entry.where()}: the manifest does not list {name}", step=entry.step)
    nearer = entry.near.open(name) if entry.near is not None else None
    if nearer is None:
        data = entry.tier.read_bytes(f"{entry.path}/{name}")
    else:
        with nearer:
            data = nearer.read()
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


class MetadataUnpickler(pickle.Unpickler):
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
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
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


def load_packs(entry: Entry, metadata: Metadata) -> PackIndex | None:
    """The checkpoint's ``packs.json``, checked against its manifest entry and DCP's metadata (None: no packs)."""
    assert entry.manifest is not None
    if entry.manifest.file(PACKS_FILE) is None:
        return None
    layout = PackIndex.from_json(load_skeleton(entry, PACKS_FILE), where=entry.where(), step=entry.step)
    for pack, size in layout.sizes.items():
        md = metadata.state_dict_metadata.get(pack)
        as_bytes = isinstance(md, TensorStorageMetadata) and md.properties.dtype == torch.uint8
        if not (as_bytes and list(md.size) == [size]):  # type: ignore[union-attr]
            raise CorruptCheckpointError(
                f"{entry.where()}: pack {pack!r} is not in the DCP metadata as {size} bytes", step=entry.step
            )
    return layout
