"""A committed checkpoint as one ordinary file: the bridge to tools that only know ``torch.load``.

The step directories stay the source of truth; an export reads one back in this process (no process group:
every shard, whoever wrote it) and writes a single file, atomically, so a reader sees the whole file or none.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from typing import Any

import torch
from fsspec.core import url_to_fs

from resilience import catalog
from resilience.errors import NoCheckpointError
from resilience.loader import Restored, plan_load, run_load
from resilience.storage import Tier


def read_committed(
    tier: Tier, step: int, *, rank: int = 0, verify: bool = True, allow_pickle: bool = False
) -> Restored:
    """Step ``step`` of ``tier``, all of it, with rank ``rank``'s own state; tensors on CPU.

    ``verify`` checksums every file first (skip it only for a checkpoint this process has just written and
    hashed itself).
    """
    entry = committed_entry(tier, step, verify=verify)
    plan = plan_load(entry, None, rank=rank)
    return run_load(entry, plan, group=None, allow_pickle=allow_pickle)


def committed_entry(tier: Tier, step: int, *, verify: bool) -> catalog.Entry:
    """Step ``step`` of ``tier``, committed with every rank's files; ``verify`` checksums every file first."""
    entry = next((e for e in catalog.scan(tier) if e.step == step and e.committed), None)
    if entry is None or entry.manifest is None or not entry.manifest.is_global:
        raise NoCheckpointError(f"No committed checkpoint of step {step} with every rank's files under {tier.url}")
    if verify:
        catalog.verify(entry, full=True)
    return entry


def write_file_atomically(
    obj: Any, path: str | os.PathLike[str], *, fsync: bool = True, storage_options: dict[str, Any] | None = None
) -> None:
    """``torch.save`` ``obj`` to ``path`` so that ``path`` is either the old file or the whole new one.

    Local paths: a temporary file beside it, flushed, then renamed over it. URLs (fsspec, with
    ``storage_options``): one upload of a local temporary file, which object stores make visible all at once.
    """
    text = os.fspath(path)
    fs, target = url_to_fs(text, **(storage_options or {}))
    local = "://" not in text or text.startswith("file://")
    directory = os.path.dirname(target) if local else None
    tmp = os.path.join(
        directory or tempfile.gettempdir(), f".{os.path.basename(target)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    if directory:
        os.makedirs(directory, exist_ok=True)
    try:
        with open(tmp, "wb") as stream:
            torch.save(obj, stream)
            if fsync:
                stream.flush()
                os.fsync(stream.fileno())
        if local:
            os.replace(tmp, target)
        else:
            fs.put_file(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
