"""A committed step read a few tensors at a time, so that an export needs far less memory than the step.

A resume (``loader.run_load``) allocates every tensor of the step at once. An export only passes each tensor through to
a file, so here the state tree is rebuilt around placeholders: tensors on torch's ``meta`` device, which have a shape
and a dtype but no memory (torch's FakeTensors would do too, but their mode imports ``torch._dynamo``: 0.4 s of CPU and
26 MiB in every process that writes a name). A writer lays its file out from them, then asks for the real tensors in
file order and gets them a batch of at most ``budget_bytes`` at a time. Peak memory is about one batch plus twice the
largest tensor (DCP reads a tensor's bytes before copying them into the target), whatever the size of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from resilience.checkpoint import packing
from resilience.checkpoint.loader import read_tensors
from resilience.checkpoint.safe_reads import load_dcp_metadata, load_packs, load_skeleton
from resilience.checkpoint.tree import tensor_keys, unflatten
from resilience.errors import CorruptCheckpointError
from resilience.storage.catalog import Entry

DEFAULT_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class ShardItem:
    """Where DCP wrote one tensor whole: ``length`` bytes at ``offset`` of shard ``file``, a ``torch.save``
    archive of a tensor that was saved with this ``shape`` and ``dtype``."""

    file: str
    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class StepReader:
    """Placeholders for the tensors of one committed (and already verified) step, and their real values.

    Args:
        entry: The step.
        allow_pickle: Decode state values stored as pickles (they run code when decoded).
        budget_bytes: The most tensor bytes read into memory at once (a larger tensor is read alone).
        on_bytes: Told how many tensor bytes each batch read.
        held: Tensors of this step already in memory, by DCP key (the staging buffers of the save that wrote
            the step: :class:`~resilience.checkpoint.staging.Loan`); they are handed out from there, not read.
    """

    def __init__(
        self,
        entry: Entry,
        *,
        allow_pickle: bool = False,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        on_bytes: Callable[[int], None] | None = None,
        held: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.entry = entry
        self.held: Mapping[str, torch.Tensor] = held or {}
        self.allow_pickle = allow_pickle
        self.budget_bytes = max(1, budget_bytes)
        self.on_bytes = on_bytes
        self.metadata = load_dcp_metadata(entry)
        self.layout = load_packs(entry, self.metadata) or packing.PackIndex()
        self._made: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._source: dict[int, tuple[str, torch.dtype]] = {}  # id(placeholder) -> (DCP key, dtype to hand out)
        self._by_storage: dict[int, torch.Tensor] = {}

    # ---- the tree, with placeholders --------------------------------------------------------------------------

    def tree(self, name: str) -> Any:
        """The state saved in the JSON file ``name`` (``state.json``, ``rank-<r>.json``), tensors as placeholders.

        Numpy arrays are read for real: the tree holds them as arrays, not tensors (RNG states, small).
        """
        skeleton = load_skeleton(self.entry, name)
        arrays = self._values(tensor_keys(skeleton, tags=("ndarray",)))
        tensors = {key: self.placeholder(key) for key in tensor_keys(skeleton, tags=("tensor",))}
        return unflatten(skeleton, {**arrays, **tensors}, allow_pickle=self.allow_pickle, where=self.entry.where())

    def placeholder(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The placeholder of DCP key ``key``, handed out as ``dtype`` (default: as saved); one per pair, so
        tensors tied in the saved state stay tied."""
        shape, saved_dtype = self._saved(key)
        dtype = dtype or saved_dtype
        made = self._made.get((key, dtype))
        if made is None:
            made = torch.empty(shape, dtype=dtype, device="meta")
            self._made[(key, dtype)] = made
            self._source[id(made)] = (key, dtype)
            self._by_storage[made.untyped_storage()._cdata] = made
        return made

    def cast(self, placeholder: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The same tensor handed out as ``dtype``."""
        key, _ = self._source[id(placeholder)]
        return self.placeholder(key, dtype)

    def is_placeholder(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self._source

    def placeholder_of(self, storage: torch.UntypedStorage) -> torch.Tensor | None:
        """The placeholder whose storage this is (``torch.save`` reports storages, not tensors)."""
        return self._by_storage.get(storage._cdata)

    # ---- where the values lie ---------------------------------------------------------------------------------

    def whole_items(self, placeholders: Iterable[torch.Tensor]) -> dict[int, ShardItem]:
        """Of ``placeholders``, those (by ``id``) whose tensor DCP wrote whole into one entry of a shard, and
        where: a tensor handed out as saved, neither packed nor cut into chunks nor passed through a stream
        transform. A writer may copy such a tensor's bytes from the file instead of reading it."""
        found = {}
        for placeholder in placeholders:
            key, dtype = self._source[id(placeholder)]
            saved = self.metadata.state_dict_metadata.get(key)
            if key in self.layout.slots or key in self.held or not isinstance(saved, TensorStorageMetadata):
                continue
            if saved.properties.dtype != dtype or len(saved.chunks) != 1:
                continue
            chunk = saved.chunks[0]
            if any(chunk.offsets) or tuple(chunk.sizes) != tuple(saved.size):
                continue
            info = self.storage_data.get(MetadataIndex(key, chunk.offsets))
            if info is None or info.transform_descriptors:
                continue
            found[id(placeholder)] = ShardItem(info.relative_path, info.offset, info.length, tuple(saved.size), dtype)
        return found

    @property
    def storage_data(self) -> dict[MetadataIndex, Any]:
        """Where each DCP entry lies (DCP's ``_StorageInfo``: file, offset, length, transforms)."""
        return cast(dict[MetadataIndex, Any], self.metadata.storage_data or {})

    def open_file(self, name: str) -> IO[bytes]:
        """A file of the step (``name`` relative to it), read past the page cache where it is not cached."""
        return self.entry.tier.open(f"{self.entry.path}/{name}")

    # ---- the real values --------------------------------------------------------------------------------------

    def read(self, placeholders: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(placeholder, its value on CPU), in the order asked, read a batch of ``budget_bytes`` at a time."""
        batch: list[torch.Tensor] = []
        size = 0
        for placeholder in placeholders:
            nbytes = self._saved_nbytes(placeholder)
            if batch and size + nbytes > self.budget_bytes:
                yield from self._read_batch(batch)
                batch, size = [], 0
            batch.append(placeholder)
            size += nbytes
        if batch:
            yield from self._read_batch(batch)

    def _read_batch(self, batch: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        values = self._values(dict.fromkeys(self._source[id(p)][0] for p in batch))
        for placeholder in batch:
            key, dtype = self._source[id(placeholder)]
            yield placeholder, values[key].to(dtype)

    def _values(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The saved tensors of ``keys``: held ones as they are in memory, DCP entries read as they are, packed
        ones out of their packs (each pack read whole, once per call: a pack is at most ``pack_bytes``)."""
        keys = list(keys)
        held = self.held
        packed = [key for key in keys if key in self.layout.slots]
        packs = {self.layout.slots[key].pack for key in packed}
        targets = {key: self._allocate(key) for key in keys if key not in self.layout.slots and key not in held}
        targets |= {pack: torch.empty(self.layout.sizes[pack], dtype=torch.uint8) for pack in packs if pack not in held}
        if targets:
            # Every target is this reader's own: the tensors DCP reads become them (no second copy in memory).
            read_tensors(self.entry, self.metadata, targets, adopt=list(targets))
        if self.on_bytes is not None:
            self.on_bytes(sum(t.nbytes for t in targets.values()))
        values = {key: held[key] if key in held else targets[key] for key in keys if key not in self.layout.slots}
        in_memory = {pack: held[pack] for pack in packs if pack in held}
        return values | packing.unpack(self.layout, packed, targets | in_memory, {})

    def _allocate(self, key: str) -> torch.Tensor:
        shape, dtype = self._saved(key)
        return torch.empty(shape, dtype=dtype)

    def _saved_nbytes(self, placeholder: torch.Tensor) -> int:
        shape, dtype = self._saved(self._source[id(placeholder)][0])
        return shape.numel() * dtype.itemsize

    def _saved(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of the saved tensor ``key``, packed or a DCP entry."""
        slot = self.layout.slots.get(key)
        if slot is not None:
            return torch.Size(slot.shape), slot.dtype
        saved = self.metadata.state_dict_metadata.get(key)
        if not isinstance(saved, TensorStorageMetadata):
            where = self.entry.where()
            raise CorruptCheckpointError(f"{where}: no tensor {key!r} in DCP metadata", step=self.entry.step)
        return saved.size, saved.properties.dtype
