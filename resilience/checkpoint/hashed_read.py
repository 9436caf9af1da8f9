"""A shard read once, from its first byte to its last, each byte hashed as it comes: the file's checksum is
checked against its manifest before any tensor read from it is used.

A load must check some files as it reads them: a durable shard read from its tier (hashing it first would
download it twice). A file parsed by ``torch.load`` is read out of order (each entry's zip directory first), so
such a file is copied whole into a private temporary file and checked there first (``_checked_copy``): every byte
written and read a second time. When every tensor the rank reads from a file becomes memory of the loader's own
(no caller's tensor is written before the check), the file is instead read in order, once: a large tensor's bytes
straight into the memory that becomes it, the rest into memory kept until the end. Only then, with the checksum
matching, are the small entries parsed and the tensors handed on; a mismatch raises before any of them is.
Where each large record lies comes from its pickle, read with an allow-list that builds nothing
(:mod:`resilience.persist.record_layout`).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

import torch
import xxhash

from resilience.errors import CorruptCheckpointError
from resilience.persist.direct_io import ALIGN, THROUGH_BYTES
from resilience.persist.record_layout import stored_record
from resilience.storage.manifest import FileEntry

_SCRATCH = 1 << 20  # read at a time between the large tensors' bytes


@dataclass(frozen=True)
class Wanted:
    """One DCP entry to read whole: ``length`` bytes at ``offset`` of the file, a tensor shaped and typed as
    ``like`` (the loader's own placeholder)."""

    offset: int
    length: int
    like: torch.Tensor


def aligned_bytes(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """``nbytes`` of new memory that starts on a block, as a ``uint8`` tensor and a view to read into: past the
    page cache the device writes there itself, with no copy out of a bounce buffer. The tensor's storage is up to a
    block larger."""
    memory = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -memory.data_ptr() % ALIGN
    return memory[skip : skip + nbytes], memory.numpy().data[skip : skip + nbytes]


def read_whole(stream: IO[bytes], view: memoryview, seen: Callable[[memoryview], None] | None = None) -> None:
    """Fill ``view`` from the stream's position (each piece shown to ``seen`` as it lands); ``EOFError`` if the
    file ends first."""
    got = 0
    while got < len(view):
        count = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not count:
            raise EOFError(f"the file ends {len(view) - got} bytes early")
        if seen is not None:
            seen(view[got : got + count])
        got += count


class _InOrder:
    """Reads a stream from its start, in order, hashing every byte it reads."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.digest = xxhash.xxh3_64()
        self.at = 0
        self._scratch = memoryview(bytearray(_SCRATCH))  # what lies between the tensors' bytes: headers, small ones
        stream.seek(0)

    def into(self, view: memoryview) -> None:
        read_whole(self.stream, view, self.digest.update)
        self.at += len(view)

    def past(self, end: int | None) -> None:
        """Read (and hash) up to ``end``, or to the end of the file."""
        while end is None or self.at < end:
            size = _SCRATCH if end is None else min(_SCRATCH, end - self.at)
            count = self.stream.readinto(self._scratch[:size])  # type: ignore[attr-defined]
            if not count:
                if end is None:
                    return
                raise EOFError(f"the file ends {end - self.at} bytes early")
            self.digest.update(self._scratch[:count])
            self.at += count


def read_hashed(
    stream: IO[bytes], item: FileEntry, wanted: Sequence[Wanted], mismatch: Callable[[str, int], None]
) -> list[torch.Tensor]:
    """The tensors of ``wanted`` (in its order), read from ``stream`` in one pass that hashes the whole file; before
    any is returned or parsed, ``mismatch(checksum, length)`` is given what was read, and raises unless it is
    ``item``'s."""
    places: dict[int, tuple[int, int]] = {}
    for index, want in enumerate(wanted):
        if want.like.nbytes >= THROUGH_BYTES:
            found = stored_record(stream, want.offset, want.length, tuple(want.like.shape), want.like.dtype)
            if found is not None and want.offset <= found[0] and found[0] + found[1] <= want.offset + want.length:
                places[index] = found[:2]
    order = sorted(range(len(wanted)), key=lambda index: wanted[index].offset)
    ends = [wanted[i].offset + wanted[i].length for i in order]
    if any(wanted[i].offset < end for i, end in zip(order[1:], ends, strict=False)) or max(ends, default=0) > item.size:
        raise CorruptCheckpointError(f"{item.path}: its entries overlap or run past its end")
    reader = _InOrder(stream)
    large: dict[int, torch.Tensor] = {}
    small: dict[int, bytearray] = {}
    for index in order:
        want = wanted[index]
        if index in places:
            start, nbytes = places[index]
            reader.past(start)
            memory, view = aligned_bytes(nbytes)
            reader.into(view)
            large[index] = memory.view(want.like.dtype).view(want.like.shape)
        else:
            reader.past(want.offset)
            small[index] = bytearray(want.length)
            reader.into(memoryview(small[index]))
    reader.past(None)
    mismatch(reader.digest.hexdigest(), reader.at)
    return [
        large[i] if i in large else torch.load(io.BytesIO(small[i]), map_location="cpu", weights_only=True)
        for i in range(len(wanted))
    ]
