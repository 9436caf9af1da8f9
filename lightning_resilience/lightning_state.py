"""Lightning's checkpoint dict, split into what all ranks share and what each rank owns, and back.

Lightning builds the checkpoint dict on every rank but writes only rank 0's, so the data loader position of the
other ranks is lost. Here the loader states (``loops.fit_loop.state_dict.combined_loader``) and the RNG state
go into the per-rank part; everything else is the shared part, identical across DDP ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from resilience.peer_loss import BoundarySnapshot
from resilience.rng import capture_rng
from resilience.session import SaveState

_LOADER_PATH = ("loops", "fit_loop", "state_dict", "combined_loader")
WEIGHTS_ONLY_MISSING = ("optimizer_states", "callbacks")  # keys a weights-only dump leaves out


def is_weights_only(checkpoint: dict[str, Any]) -> bool:
    return not any(key in checkpoint for key in WEIGHTS_ONLY_MISSING)


def split_checkpoint(checkpoint: dict[str, Any], trainer: pl.Trainer | None = None) -> SaveState:
    """(shared state, this rank's state, manifest extras); the caller's dict is not modified. With the
    ``trainer``, the extras also name its loggers' versions, which a resume continues."""
    shared = dict(checkpoint)
    loaders = None
    node: dict[str, Any] = shared
    for key in _LOADER_PATH[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            break
        child = dict(child)  # copy along the path only
        node[key] = child
        node = child
    else:
        loaders = node.pop(_LOADER_PATH[-1], None)
    rank_state = {"rng": capture_rng(), "combined_loader": loaders}
    extra: dict[str, Any] = {k: checkpoint[k] for k in ("epoch", "global_step") if isinstance(checkpoint.get(k), int)}
    if trainer is not None:
        extra["logger_versions"] = logger_versions(trainer)
    return SaveState(shared, rank_state, {"adapter": "lightning", **extra})


def logger_versions(trainer: pl.Trainer) -> list[int | str | None]:
    """Each logger's version (run id) as far as JSON can hold it, in the Trainer's order."""
    versions: list[int | str | None] = []
    for logger in trainer.loggers:
        try:
            version = logger.version
        except Exception:  # a logger that needs its service for this: no version to continue
            version = None
        versions.append(version if isinstance(version, (int, str)) else None)
    return versions


def full_state(trainer: pl.Trainer) -> SaveState:
    """What the session saves on its own (interval and emergency saves): everything a resume needs."""
    return split_checkpoint(trainer._checkpoint_connector.dump_checkpoint(weights_only=False), trainer)


def boundary_snapshot(trainer: pl.Trainer, step: int) -> BoundarySnapshot:
    """The state at a step boundary, for a survivor save: the loops (with each loader's position) and the RNG
    by value now, cheaply; the rest, with its hooks (``on_save_checkpoint``), only if a survivor save comes."""
    fit_loop = trainer.fit_loop.state_dict()
    rank_state = {"rng": capture_rng(), "combined_loader": fit_loop.get("state_dict", {}).get(_LOADER_PATH[-1])}

    def shared() -> SaveState:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint["loops"] = {**checkpoint.get("loops", {}), "fit_loop": fit_loop}
        return dataclasses.replace(split_checkpoint(checkpoint, trainer), rank_state=rank_state)

    return BoundarySnapshot(step, rank_state, shared)


def merge_checkpoint(shared: dict[str, Any], rank_state: dict[str, Any] | None) -> dict[str, Any]:
    """Put this rank's loader states back where Lightning looks for them."""
    if not rank_state or rank_state.get("combined_loader") is None:
        return shared
    loaders = rank_state["combined_loader"]
    if saved_at_epoch_end(shared):
        loaders = [_finished(state) for state in loaders]
    node = shared
    for key in _LOADER_PATH[:-1]:
        node = node.setdefault(key, {})
    node[_LOADER_PATH[-1]] = loaders
    return shared


def as_name(shared: dict[str, Any], rank0_state: dict[str, Any] | None, keys: list[str]) -> dict[str, Any]:
    """The dict a ``.ckpt`` file holds, as Lightning would have written it: rank 0's loader state, and only
    the top-level keys the save asked for (a weights-only save asks for fewer)."""
    checkpoint = merge_checkpoint(dict(shared), rank0_state)
    return {key: checkpoint[key] for key in keys if key in checkpoint}


def drop_foreign_rank_state(rank_state: Any, saved_world: int, world: int, where: str) -> Any:
    """Per-rank state (RNG, loader position) of another world size does not fit this one: drop it, say so."""
    if saved_world == world:
        return rank_state
    rank_zero_warn(
        f"{where} was saved by {saved_world} processes and this run has {world}: the model, optimizers and "
        "schedulers are restored (resharded), but each rank's RNG and data loader position start afresh "
        "(the interrupted epoch is replayed from its start)"
    )
    return None


def _finished(state: Any) -> Any:
    """A StatefulDataLoader state taken after an epoch's last batch, marked as the end of that epoch.

    Lightning never asks a sized loader for one batch too many, so the saved iterator does not know it is
    exhausted: restored as is, it yields an empty epoch first (shifting epoch numbers and per-epoch
    schedules), and a ``StatefulDistributedSampler`` carries its position into the next epoch. Marked as
    finished, the loader starts the next epoch afresh, keeping the sampler's generator state.
    """
    if not isinstance(state, dict) or "_iterator_finished" not in state:
        return state

    def rewind(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: 0 if k in ("yielded", "samples_yielded") and isinstance(v, int) else rewind(v)
                for k, v in node.items()
            }
        return node

    return {**rewind(state), "_iterator_finished": True}


def saved_at_epoch_end(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint was taken after the last batch of an epoch."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    return bool(fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch", False))
