"""How a rank's share of a save becomes DCP files: the planner and the writer the pipeline (and a survivor
save) hand to ``dcp.save``, and the versions a manifest records.

Every tensor is an entry of its own, as DCP writes it: a ``torch.save`` record at an offset of the rank's file,
which any DCP reader loads. DCP's cost is per entry, and ``torch.save`` is most of it for a small tensor (about
50 us, 39 writes of a few bytes). Its bytes for a tensor are its storage's bytes between a head and a tail that
depend only on the tensor's dtype, shape and stride while CRC-32s are off (:mod:`resilience.persist.tensor_records`), so
the writer makes each such pair once and writes the three pieces.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _split_by_size_and_type
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from resilience import __version__
from resilience.persist import tensor_records
from resilience.persist.direct_io import Written
from resilience.storage.dcp_fs import HashedFileSystem
from resilience.storage.tiers import LocalTier


class PiecePlanner(DefaultSavePlanner):
    """DCP's planner, reading a :class:`~resilience.persist.helper_process.Piece` (a DTensor shard without its
    mesh) as its local tensor; its write items came with it.

    With ``cache_key``, DCP's plan caching is on under that key: a rank whose local plan is the one of its last
    save sends an empty plan, and the coordinator reuses the global plan and metadata it made then, so the
    per-save gather, deduplication and scatter do not grow with the ranks while the state's structure stays the
    same (any changed plan is merged in and planned again). DCP keeps the cache per class by default; a key per
    pipeline keeps managers of one process, and their process groups, apart.
    """

    def __init__(self, cache_key: str | None = None) -> None:
        super().__init__(enable_plan_caching=cache_key is not None)
        if cache_key is not None:
            self._cached_plans_key = cache_key

    def lookup_object(self, index: Any) -> Any:
        found = self.state_dict.get(index.fqn)
        if found is not None and hasattr(found, "items") and hasattr(found, "local"):
            return found.local
        return super().lookup_object(index)


class RecordingWriter(FileSystemWriter):
    """FileSystemWriter that remembers which files this rank wrote, so each rank hashes only its own, and
    writes them through :class:`~resilience.storage.dcp_fs.HashedFileSystem` into the folder ``path`` (a local
    tier of its own): past the page cache with ``direct``, synced as each file closes with ``sync_files``, hashed on
    the way out (:attr:`hashes`)."""

    def __init__(self, path: str, *, direct: bool = False, sync_files: bool = True, **kwargs: Any):
        super().__init__(path, sync_files=False, **kwargs)  # our streams sync themselves as they close
        self.files = HashedFileSystem(LocalTier(path), direct=direct, fsync=sync_files)
        self.fs = self.files  # type: ignore[assignment]
        self.written: set[str] = set()

    @property
    def hashes(self) -> dict[str, Written]:
        return self.files.written

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        plain = self.serialization_format == SerializationFormat.TORCH_SAVE and not self.transforms.extensions
        if plain and self.single_file_per_rank:
            future = self._write_files(plan, planner)
        else:
            future = super().write_data(plan, planner)
        for result in future.value():
            self.written.add(result.storage_data.relative_path)
        return future

    def _write_files(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's files and entries (``<prefix><i>.distcp``, one per write thread, the same buckets), each
        tensor's record written by :func:`resilience.persist.tensor_records.write`."""
        buckets = _split_by_size_and_type(self.thread_count, plan.items)
        names = [f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]
        if len(buckets) == 1:
            results = self._write_file(names[0], buckets[0], planner)
        else:
            with ThreadPoolExecutor(len(buckets), thread_name_prefix="dcp-write") as pool:
                parts = pool.map(self._write_file, names, buckets, [planner] * len(buckets))
                results = [result for part in parts for result in part]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items: Iterable[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO):  # bytes first, as DCP
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):
                    offset = stream.tell()
                    stream.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()  # a view: its record holds its own elements only, as DCP's does
                    tensor_records.entry_start(stream, tensor)
                    offset = stream.tell()
                    tensor_records.write(stream, tensor)
                length = stream.tell() - offset
                where = StorageInfo(name, offset, length)
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=where))
        return results


def versions() -> dict[str, str]:
    return {
        "training-resilience": __version__,
        "torch": torch.__version__.split("+")[0],
        "python": sys.version.split()[0],
    }


def space_hint(directory: str, need: int) -> str:
    """Name a full disk: ENOSPC inside ``torch.save`` surfaces only as its zip writer's "unexpected pos" error."""
    try:
        free = shutil.disk_usage(directory if os.path.isdir(directory) else os.path.dirname(directory)).free
    except OSError:
        return ""
    if free >= need:
        return ""
    return f"; only {free} bytes are free under {directory}, less than the {need} bytes to write: the disk is full"
