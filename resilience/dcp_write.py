"""How a rank's share of a save becomes DCP files: the planner and the writer the pipeline (and a survivor
save) hand to ``dcp.save``, and the versions a manifest records."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from resilience import __version__
from resilience.direct_io import Written
from resilience.hashed_fs import HashedFileSystem


class PiecePlanner(DefaultSavePlanner):
    """DCP's planner, reading a :class:`~resilience.helper.Piece` (a DTensor shard without its mesh) as its
    local tensor; its write items came with it.

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
    writes them through :class:`~resilience.hashed_fs.HashedFileSystem`: past the page cache with ``direct``,
    synced as each file closes with ``sync_files``, hashed on the way out (:attr:`hashes`)."""

    def __init__(
        self, path: str, *, direct: bool = False, sync_files: bool = True, record_crcs: bool = False, **kwargs: Any
    ):
        super().__init__(path, sync_files=False, **kwargs)  # our streams sync themselves as they close
        self.files = HashedFileSystem(direct=direct, fsync=sync_files, record_crcs=record_crcs)
        self.fs = self.files
        self.written: set[str] = set()

    @property
    def hashes(self) -> dict[str, Written]:
        return self.files.written

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        for result in future.value():
            self.written.add(result.storage_data.relative_path)
        return future


def versions() -> dict[str, str]:
    return {
        "training-resilience": __version__,
        "torch": torch.__version__.split("+")[0],
        "python": sys.version.split()[0],
    }
