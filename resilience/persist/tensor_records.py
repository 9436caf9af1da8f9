"""A tensor's ``torch.save`` record, written as torch writes it, without torch's per-record cost.

``torch.save`` of a small tensor costs about 50 us, most of it pickling and 39 small writes; a DCP checkpoint
holds one such record per tensor, so a state of 10,000 small tensors spent half a second there. With CRC-32s off
(:func:`resilience.persist.direct_io._no_zip_crcs`), the record's bytes are the tensor storage's bytes between a
head and a tail that depend only on the tensor's type, dtype, shape and stride. The pair is taken from torch itself,
once per such kind of tensor: two probes whose storages hold all-zero and all-one bytes are saved, and the pair is
used only when the two records differ in exactly the storage's bytes, in one run. Anything else (CRC-32s on, a
tensor over :data:`SMALL_BYTES`, an empty or unusual tensor, a torch whose records vary otherwise) is saved by
``torch.save``.
"""

from __future__ import annotations

import contextlib
import io
import threading
from typing import IO, cast

import numpy as np
import torch

from resilience.persist.direct_io import ALIGN, THROUGH_BYTES, aligned_storages

SMALL_BYTES = THROUGH_BYTES
"""Larger tensors go through ``torch.save``: their record's cost is their bytes, and a probe would allocate and
save two tensors of their size. Their entries start on a block, and their storages are written from where they
are (:data:`~resilience.persist.direct_io.THROUGH_BYTES`)."""

_Kind = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], str]
_pairs: dict[_Kind, tuple[bytes, bytes] | None] = {}
_lock = threading.Lock()


def write(stream: io.IOBase, tensor: torch.Tensor) -> None:
    """Write ``torch.save(tensor)``'s bytes to ``stream``; ``tensor`` is on the CPU and owns its whole storage.

    A large tensor's record puts its storage on a block boundary of the file (the caller starts the entry on
    one, :func:`entry_start`): a staging buffer, which starts on a page, then goes to disk past the page cache
    without being copied first (:class:`~resilience.persist.direct_io.HashedFileStream`)."""
    pair = _pair(tensor)
    if pair is None:
        with aligned_storages() if tensor.nbytes > SMALL_BYTES else contextlib.nullcontext():
            torch.save(tensor, cast(IO[bytes], stream))
        return
    head, tail = pair
    stream.write(head)
    stream.write(_storage_bytes(tensor))
    stream.write(tail)


def entry_start(stream: io.IOBase, tensor: torch.Tensor) -> None:
    """Pad ``stream`` with zeros to the next block before a large tensor's entry (DCP reads each entry at its
    offset; the bytes between entries are no entry's). Small entries stay packed: a block each would multiply
    the size of a state of many small tensors."""
    if tensor.nbytes > SMALL_BYTES and stream.tell() % ALIGN:
        stream.write(bytes(ALIGN - stream.tell() % ALIGN))


def _pair(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    if torch.serialization.get_crc32_options() or not _plain(tensor):
        return None
    alignment = str(getattr(torch.utils.serialization.config.save, "storage_alignment", 64))  # part of the layout
    kind = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), alignment)
    if kind not in _pairs:
        pair = _probe(tensor)
        with _lock:
            _pairs[kind] = pair
    return _pairs[kind]


def _plain(tensor: torch.Tensor) -> bool:
    """A dense CPU tensor of its own storage, with nothing but its values to pickle."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.storage_offset() == 0
        and 0 < tensor.untyped_storage().nbytes() == tensor.nbytes <= SMALL_BYTES
        and not tensor.__dict__
    )


def _probe(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The head and tail around the storage's bytes, or None when torch's records of this kind of tensor do not
    split that way."""
    records = []
    for fill in (0x00, 0xFF):
        probe = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        if probe.untyped_storage().nbytes() != tensor.nbytes:
            return None
        _byte_view(probe).fill_(fill)
        buffer = io.BytesIO()
        torch.save(probe, buffer)
        records.append(buffer.getvalue())
    zeros, ones = records
    if len(zeros) != len(ones):
        return None
    differ = np.flatnonzero(np.frombuffer(zeros, np.uint8) != np.frombuffer(ones, np.uint8))
    if len(differ) != tensor.nbytes or differ[-1] - differ[0] + 1 != tensor.nbytes:
        return None
    start = int(differ[0])
    return zeros[:start], zeros[start + tensor.nbytes :]


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s storage as a flat ``uint8`` tensor (any dtype, any stride)."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def _storage_bytes(tensor: torch.Tensor) -> memoryview:
    return _byte_view(tensor).numpy().data
