"""Hugging Face's safetensors layout, written one tensor at a time from a :class:`StepReader`.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, and the tensors' bytes back to back. The header needs only shapes and dtypes, which
the placeholders have, so it is written first and the bytes follow in header order: nothing is held but the
reader's current batch.

The layout is ``save_pretrained``'s: ``model.safetensors`` when the weights fit in one shard, else
``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json`` (``metadata.total_size`` and a
``weight_map`` from each name to its file). Every header carries ``{"format": "pt"}``, which
``transformers`` checks. ``config.json`` is not written: it describes the model class, which the checkpoint
does not record (``model.config.save_pretrained(out)`` writes it).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import IO, Any

import torch

from resilience.checkpoint.step_reader import StepReader
from resilience.errors import ConfigError
from resilience.formats import raw_bytes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default, "5GB"
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class Shard:
    """One file of the export: its name and its tensors, in file order."""

    name: str
    tensors: list[tuple[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.tensors)


def plan_shards(tensors: list[tuple[str, torch.Tensor]], max_shard_bytes: int) -> list[Shard]:
    """Tensors into files of at most ``max_shard_bytes`` each, in order, as ``save_pretrained`` splits them (a
    larger tensor gets a file of its own). Within a file, wider dtypes come first, so that every tensor starts
    at a multiple of its element size."""
    for name, tensor in tensors:
        if tensor.dtype not in _DTYPES:
            raise ConfigError(
                f"{name} is {tensor.dtype}, which safetensors has no code for here: export it with --format torch"
            )
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        if groups[-1] and size + tensor.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += tensor.nbytes
    ordered = [sorted(group, key=lambda item: (-item[1].element_size(), item[0])) for group in groups]
    if len(ordered) == 1:
        return [Shard(SINGLE_FILE, ordered[0])]
    count = len(ordered)
    return [Shard(f"model-{i + 1:05d}-of-{count:05d}.safetensors", group) for i, group in enumerate(ordered)]


def index(shards: list[Shard]) -> dict[str, Any]:
    """The ``model.safetensors.index.json`` of sharded weights."""
    return {
        "metadata": {"total_size": sum(shard.nbytes for shard in shards)},
        "weight_map": {name: shard.name for shard in shards for name, _ in shard.tensors},
    }


def write_shard(shard: Shard, stream: IO[bytes], reader: StepReader, metadata: dict[str, str]) -> None:
    """The header, then each tensor's bytes as the reader hands them out."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    offset = 0
    for name, tensor in shard.tensors:
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    stream.write(struct.pack("<Q", len(text)))
    stream.write(text)
    for _, value in reader.read(tensor for _, tensor in shard.tensors):
        stream.write(raw_bytes(value))
