"""Pointer files: what a ``.ckpt`` path written through the plugin holds.

Lightning's ``ModelCheckpoint`` names, ranks, links and deletes checkpoint *files*; the engine keeps each
checkpoint as a committed ``step-<N>`` directory in its tiers. A pointer file is the small JSON bridge: it
lets every ``ModelCheckpoint`` feature (top-k, ``save_last``, ``ckpt_path="best"``) work on names while the
data stays in one place, and deleting a name never deletes data another name or the resume still needs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Literal

from fsspec.core import url_to_fs

FORMAT = "training-resilience/pointer"
_MAX_BYTES = 64 << 10


@dataclass(frozen=True)
class Pointer:
    """``select="step"`` names one checkpoint; ``"latest"`` means the newest that verifies at load time."""

    select: Literal["step", "latest"]
    step: int | None
    local_root: str
    durable_url: str | None


def write_pointer(path: str | os.PathLike[str], pointer: Pointer) -> None:
    """Replace ``path`` atomically with the pointer (tmp + rename locally, one PUT on object stores)."""
    fs, target = url_to_fs(os.fspath(path))
    data = json.dumps({"format": FORMAT, "version": 1, **asdict(pointer)}, indent=1).encode()
    parent = os.path.dirname(target)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if fs.protocol in ("file", "local") or "file" in fs.protocol:
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, target)
    else:
        fs.pipe_file(target, data)


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer at ``path``, or None when ``path`` is something else (e.g. a ``torch.save`` checkpoint)."""
    fs, target = url_to_fs(os.fspath(path))
    if not fs.isfile(target) or fs.size(target) > _MAX_BYTES:
        return None
    try:
        body = json.loads(fs.cat_file(target))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        return None
    select, step = body.get("select"), body.get("step")
    if select not in ("step", "latest") or (select == "step" and not isinstance(step, int)):
        raise ValueError(f"{path} is a damaged checkpoint pointer ({body!r}); delete it or pass another ckpt_path")
    return Pointer(select, step, str(body.get("local_root")), body.get("durable_url"))


def remove_pointer(path: str | os.PathLike[str]) -> None:
    """Delete a pointer file (only the name: the data it points to is the engine's retention's to delete)."""
    fs, target = url_to_fs(os.fspath(path))
    if fs.exists(target):
        fs.rm(target)
