"""A name under a sharded strategy: Lightning's sharded checkpoint directory, made from a committed engine step.

Lightning's ``ModelParallelStrategy`` (and ``FSDPStrategy`` with sharded state dicts) saves a checkpoint as a
directory: DCP files of ``{"state_dict": ..., "optimizer_0": ..., ...}`` as DCP flattens it, and ``meta.pt``
(``torch.save`` of everything else). Its loader (``fit(ckpt_path=...)``) and
``python -m lightning.fabric.utilities.consolidate_checkpoint`` read such directories. A name is written as one
once its step is committed: the DCP part as a view of the step (:mod:`resilience.checkpoint.dcp_view`: hard links to the
step's shards, no tensor written twice), ``meta.pt`` from the step's small state; the directory is built beside
the name and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from resilience.checkpoint.dcp_view import placeholders, write_view
from resilience.checkpoint.loader import plan_load, run_load
from resilience.checkpoint.safe_reads import load_skeleton
from resilience.checkpoint.tree import unflatten
from resilience.formats.export import committed_entry
from resilience.formats.lightning_ckpt import as_name
from resilience.storage.layout import STATE_FILE
from resilience.storage.tiers import LocalTier, fsync_dir

META_FILE = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
SHARDED_KEYS = ("state_dict", "optimizer_states")  # what Lightning's sharded save moves into the DCP files


def write_sharded_name(
    local: LocalTier,
    step: int,
    path: str,
    keys: list[str],
    *,
    verify: bool,
    allow_pickle: bool,
    extra: dict[str, Any],
) -> None:
    """Make ``path`` Lightning's sharded checkpoint of committed step ``step``, with the top-level ``keys`` asked
    for (a weights-only save asks for no optimizer states); ``extra`` goes into ``meta.pt`` as well."""
    if "://" in path:
        raise ValueError(
            f"{path}: sharded checkpoints are local directories (Lightning's own sharded saves are too); "
            "give ModelCheckpoint a local dirpath, the durable copy goes to the plugin's durable_url"
        )
    entry = committed_entry(local, step, verify=verify)
    # the small part, read whole: loops, callbacks, schedulers, rank 0's loader position
    plan = plan_load(entry, None, rank=0, leave_out=SHARDED_KEYS)
    small = run_load(entry, plan, group=None, allow_pickle=allow_pickle)
    meta = as_name(small.state, small.rank_state, [key for key in keys if key not in SHARDED_KEYS])
    # the sharded part, as Lightning's save converts it, with stand-ins for the tensors
    skeleton = load_skeleton(entry, STATE_FILE)
    stand_ins = placeholders(plan.metadata)
    where = entry.where()
    tree = {"state_dict": unflatten(skeleton["state_dict"], stand_ins, allow_pickle=allow_pickle, where=where)}
    if "optimizer_states" in keys:
        for i, optimizer in enumerate(skeleton.get("optimizer_states", [])):
            tree[f"optimizer_{i}"] = unflatten(optimizer, stand_ins, allow_pickle=allow_pickle, where=where)
    with folder_in_place(path) as building:
        write_view(entry, plan.metadata, tree, stand_ins, building)
        with open(os.path.join(building, META_FILE), "wb") as stream:
            torch.save({**meta, **extra}, stream)
            stream.flush()
            os.fsync(stream.fileno())


@contextlib.contextmanager
def folder_in_place(path: str) -> Iterator[str]:
    """A new folder beside ``path``, to fill in the block; it becomes ``path`` once the block ends without an
    error, so ``path`` is never a half-written checkpoint (an earlier one of that name goes then)."""
    parent, base = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    building = os.path.join(parent, f".{base}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(building)
    try:
        yield building
        fsync_dir(building)
        _put_in_place(building, path)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    fsync_dir(parent)


def _put_in_place(building: str, path: str) -> None:
    """Rename the finished directory to ``path``; an earlier checkpoint of that name (``last.ckpt``) goes first."""
    if os.path.isdir(path) and not os.path.islink(path):
        aside = f"{building}.old"
        os.rename(path, aside)
        os.rename(building, path)
        shutil.rmtree(aside, ignore_errors=True)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.rename(building, path)


def remove_name(path: str) -> None:
    """Delete a name: a sharded checkpoint directory, or a file (or a link, e.g. ``save_last="link"``)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
