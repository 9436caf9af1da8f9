"""Lightning's checkpoint dict, split into what all ranks share and what each rank owns, and back.

Lightning builds the checkpoint dict on every rank but writes only rank 0's, so the data loader position of the
other ranks is lost. Here the loader states (``loops.fit_loop.state_dict.combined_loader``) and the RNG state
go into the per-rank part; everything else is the shared part, identical across DDP ranks. The way back (a
rank's dict, or the ``.ckpt`` a name holds) is plain data and lives in the engine
(``resilience.formats.lightning_ckpt``), so that ``resilience export`` writes the same file without Lightning.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl

from resilience.formats.lightning_ckpt import (
    LOADER_PATH,
    as_name,
    is_weights_only,
    merge_checkpoint,
    saved_at_epoch_end,
)
from resilience.rng import capture_rng
from resilience.session import SaveState

__all__ = [
    "as_name",
    "drop_foreign_rank_state",
    "full_state",
    "is_weights_only",
    "merge_checkpoint",
    "saved_at_epoch_end",
    "split_checkpoint",
]


def split_checkpoint(checkpoint: dict[str, Any]) -> SaveState:
    """(shared state, this rank's state, manifest extras); the caller's dict is not modified."""
    shared = dict(checkpoint)
    loaders = None
    node: dict[str, Any] = shared
    for key in LOADER_PATH[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            break
        child = dict(child)  # copy along the path only
        node[key] = child
        node = child
    else:
        loaders = node.pop(LOADER_PATH[-1], None)
    rank_state = {"rng": capture_rng(), "combined_loader": loaders}
    extra = {k: checkpoint[k] for k in ("epoch", "global_step") if isinstance(checkpoint.get(k), int)}
    return SaveState(shared, rank_state, {"adapter": "lightning", **extra})


def full_state(trainer: pl.Trainer) -> SaveState:
    """What the session saves on its own (interval and emergency saves): everything a resume needs."""
    return split_checkpoint(trainer._checkpoint_connector.dump_checkpoint(weights_only=False))


def drop_foreign_rank_state(rank_state: Any, saved_world: int, world: int, where: str) -> Any:
    """Per-rank state (RNG, loader position) of another world size does not fit this one: drop it, say so."""
    if saved_world == world:
        return rank_state
    warnings.warn(
        f"{where} was saved by {saved_world} processes and this run has {world}: the model, optimizers and "
        "schedulers are restored (resharded), but each rank's RNG and data loader position start afresh "
        "(the interrupted epoch is replayed from its start)",
        stacklevel=3,
    )
    return None
