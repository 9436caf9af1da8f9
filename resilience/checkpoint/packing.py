"""Reading the packed steps of earlier releases.

Those releases laid small plain tensors into a few flat byte buffers, DCP entries ``__packs__/<i>``, with
``packs.json`` saying where each tensor lies: DCP's per-entry cost was then too high for states of thousands
of small tensors. A step so saved is not one that DCP's own readers can read tensor by tensor, so saves no
longer pack (:mod:`resilience.persist.tensor_records` made an entry cheap instead); the steps already saved still load.
A load checks ``packs.json`` as hostile input, reads the packs through DCP like any plain tensor (so any number
of ranks can read them), and copies each slot into the target or into a tensor of its own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from resilience.errors import CorruptCheckpointError
from resilience.storage.layout import PACK_PREFIX, PACKS_FILE
from resilience.storage.manifest import MAX_FILE_BYTES

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


@dataclass
class PackIndex:
    """Which tensor keys are packed where, and how big each pack is (empty: nothing packed)."""

    slots: dict[str, Slot] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, *, where: str, step: int | None = None) -> PackIndex:
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


def unpack(
    layout: PackIndex, keys: Iterable[str], packs: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]
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
