"""Small plain tensors travel through DCP packed into a few flat byte buffers.

DCP's cost is per item, not per byte: every tensor is a planned write item, a ``torch.save`` of its own in the
shard file, an entry of the pickled ``.metadata`` that rank 0 gathers and broadcasts, and a read item when it is
loaded. A state of 10,000 small tensors spent seconds in that bookkeeping and milliseconds moving bytes. Laid
into buffers of up to ``pack_bytes``, the small ones leave DCP a handful of items whatever their number.

Only plain tensors are packed: they are the same on every rank (a DTensor's shards are not, and are never
packed), so every rank computes the same layout from the state's keys, dtypes and shapes without a message
(the save checks that with a digest in its one all-reduce), and each pack is dealt to one rank like any
replicated tensor. Rank 0 writes the layout to ``packs.json``, which the manifest checksums; a load checks it as
hostile input, reads the packs through DCP like any plain tensor (so any number of ranks can read them), and
copies each slot into the target or into a tensor of its own.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor, distribute_tensor

from resilience.errors import CorruptCheckpointError
from resilience.layout import PACK_PREFIX, PACKS_FILE, pack_key
from resilience.manifest import MAX_FILE_BYTES

ALIGN = 64  # every slot starts 64-byte aligned: a byte view of it can be viewed as any dtype
_MAX_DIMS = 64
_PACK_NAME = re.compile(r"^" + re.escape(PACK_PREFIX) + r"(0|[1-9][0-9]{0,8})$")


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies: bytes ``offset .. offset + nbytes`` of pack ``pack``, as ``dtype`` and ``shape``."""

    pack: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _element_size(self.dtype)

    def view(self, pack: torch.Tensor) -> torch.Tensor:
        """The slot in ``pack`` (a flat ``uint8`` buffer), viewed as its tensor: no copy."""
        return pack[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class PackShare:
    """One pack that this rank stages and writes: its size, its slots and, in the same order, their tensors."""

    nbytes: int
    slots: tuple[Slot, ...]
    sources: list[torch.Tensor]


@dataclass(eq=False)
class PackLayout:
    """Which tensor keys are packed where, and how big each pack is (empty: nothing packed)."""

    slots: dict[str, Slot] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.slots)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackLayout) and self.encoded == other.encoded

    __hash__ = None  # type: ignore[assignment]

    @cached_property
    def encoded(self) -> bytes:
        """The ``packs.json`` of this layout."""
        body = {
            "packs": self.sizes,
            "slots": {
                key: [s.pack, s.offset, str(s.dtype).removeprefix("torch."), list(s.shape)]
                for key, s in self.slots.items()
            },
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @cached_property
    def digest(self) -> int:
        """A 62-bit fingerprint, for ranks to check they computed the same layout (fits an int64 all-reduce)."""
        return xxhash.xxh3_64_intdigest(self.encoded) >> 2

    @cached_property
    def _by_pack(self) -> dict[str, list[tuple[str, Slot]]]:
        out: dict[str, list[tuple[str, Slot]]] = {pack: [] for pack in self.sizes}
        for key, slot in self.slots.items():
            out[slot.pack].append((key, slot))
        return out

    def units(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What is dealt out to the ranks that write: the unpacked tensors, and each pack (a meta tensor of its
        size) where its first member was, so that the deal sees the same order on every rank."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            slot = self.slots.get(key)
            if slot is None:
                out[key] = tensor
            elif slot.pack not in out:
                out[slot.pack] = torch.empty(self.sizes[slot.pack], dtype=torch.uint8, device="meta")
        return out

    def shares(self, tensors: Mapping[str, torch.Tensor], packs: Iterable[str]) -> dict[str, PackShare]:
        """The packs named, each with its members' tensors from ``tensors``."""
        out = {}
        for pack in packs:
            members = self._by_pack[pack]
            out[pack] = PackShare(
                self.sizes[pack], tuple(slot for _, slot in members), [tensors[key] for key, _ in members]
            )
        return out

    @classmethod
    def from_json(cls, data: Any, *, where: str, step: int | None = None) -> PackLayout:
        """Parse and check a ``packs.json`` (read from storage, so treated as hostile)."""

        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: {PACKS_FILE} is invalid: {why}", step=step)

        if not (isinstance(data, dict) and isinstance(data.get("packs"), dict) and isinstance(data.get("slots"), dict)):
            raise bad("expected an object with 'packs' and 'slots'")
        sizes: dict[str, int] = {}
        for name, size in data["packs"].items():
            if not _PACK_NAME.match(name) or type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
                raise bad(f"pack {name!r} of {size!r} bytes")
            sizes[name] = size
        slots: dict[str, Slot] = {}
        for key, raw in data["slots"].items():
            if not isinstance(raw, list) or len(raw) != 4:
                raise bad(f"the slot of {key!r} is not [pack, offset, dtype, shape]")
            pack, offset, dtype_name, shape = raw
            dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
            if (
                pack not in sizes
                or type(offset) is not int
                or not 0 <= offset <= sizes[pack]
                or offset % ALIGN
                or not isinstance(dtype, torch.dtype)
                or _quantized(dtype)
                or not isinstance(shape, list)
                or len(shape) > _MAX_DIMS
                or not all(type(d) is int and 0 <= d <= MAX_FILE_BYTES for d in shape)
            ):
                raise bad(f"the slot of {key!r} is {str(raw)[:200]}")
            slot = Slot(pack, offset, dtype, tuple(shape))
            if offset + slot.nbytes > sizes[pack]:
                raise bad(f"the slot of {key!r} ends past its pack")
            slots[key] = slot
        return cls(slots, sizes)


def packable(tensor: torch.Tensor) -> bool:
    """A plain dense tensor in host or CUDA memory: its bytes can be copied into a pack and viewed back."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)  # not a DTensor, nor any other subclass
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type in ("cpu", "cuda")
    )


def plan(tensors: Mapping[str, torch.Tensor], *, below_bytes: int, pack_bytes: int) -> PackLayout:
    """Lay the plain tensors of fewer than ``below_bytes`` bytes, in order, into packs of up to ``pack_bytes``."""
    slots: dict[str, Slot] = {}
    sizes: dict[str, int] = {}
    reserved = next((key for key in tensors if key.startswith(PACK_PREFIX)), None)
    if reserved is not None:
        raise ValueError(f"state key {reserved!r}: keys starting with {PACK_PREFIX!r} are reserved for packed tensors")
    if below_bytes <= 0:
        return PackLayout(slots, sizes)
    pack, used = "", 0
    for key, tensor in tensors.items():
        if not packable(tensor):
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= below_bytes:
            continue
        offset = -(-used // ALIGN) * ALIGN
        if not pack or offset + nbytes > pack_bytes:
            if pack:
                sizes[pack] = used
            pack, offset = pack_key(len(sizes)), 0
        slots[key] = Slot(pack, offset, tensor.dtype, tuple(tensor.shape))
        used = offset + nbytes
    if pack:
        sizes[pack] = used
    return PackLayout(slots, sizes)


def unpack(
    layout: PackLayout, keys: Iterable[str], packs: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The tensors of the packed ``keys``, out of the packs read: copied into their target where one is given
    (a DTensor gets its local part), else into a tensor of their own (never a view that keeps a pack alive)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key in keys:
            slot = layout.slots[key]
            whole = slot.view(packs[slot.pack])
            target = targets.get(key)
            if target is None:
                out[key] = whole.clone()
            elif isinstance(target, DTensor):
                # no communication: every rank holds the whole tensor and keeps its own part of it
                part = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
                target._local_tensor.copy_(part._local_tensor)
                out[key] = target
            else:
                target.copy_(whole)
                out[key] = target
    return out


def _element_size(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def _quantized(dtype: torch.dtype) -> bool:
    return dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)
