"""Lightning's checkpoint dict, split into what all ranks share and what each rank owns, and back; what the
Trainer's state says to the plugin (inside a fit or not, where its loggers' rows stand).

Lightning builds the checkpoint dict on every rank but writes only rank 0's, so the data loader position of the
other ranks is lost. Here the loader states (``loops.fit_loop.state_dict.combined_loader``) and the RNG state
go into the per-rank part; everything else is the shared part. Of that, only the weights and the optimizer
states are alike on every DDP rank, and the ranks write equal parts of them; the rest (callbacks above all:
``ModelCheckpoint`` keeps the scores of a metric each rank logs from its own batches unless it is logged with
``sync_dist=True``, and its file names may hold them) is rank 0's, as in Lightning's own file. The way back (a
rank's dict, or the ``.ckpt`` a name holds) is plain data and lives in the engine
(``resilience.formats.lightning_ckpt``), so that ``resilience export`` writes the same file without Lightning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from resilience.checkpoint import continuity
from resilience.checkpoint.rng import capture_rng
from resilience.formats.lightning_ckpt import LOADER_PATH, split_loaders
from resilience.recovery.peer_loss import BoundarySnapshot
from resilience.session import SaveState

REPLICATED = ("state_dict", "optimizer_states")  # the checkpoint dict's keys every DDP rank holds alike


def split_checkpoint(checkpoint: dict[str, Any], trainer: pl.Trainer | None = None) -> SaveState:
    """(shared state, this rank's state, manifest extras); the caller's dict is not modified. With the
    ``trainer``, the extras also name its loggers' versions, which a resume continues."""
    shared, loaders = split_loaders(checkpoint)
    rank_state = {"rng": capture_rng(), "combined_loader": loaders}
    extra: dict[str, Any] = {k: checkpoint[k] for k in ("epoch", "global_step") if isinstance(checkpoint.get(k), int)}
    if trainer is not None:
        extra["logger_versions"] = continuity.logger_versions(trainer.loggers)
    return SaveState(shared, rank_state, {"adapter": "lightning", **extra}, replicated=REPLICATED)


def full_state(trainer: pl.Trainer) -> SaveState:
    """What the session saves on its own (interval and emergency saves): everything a resume needs."""
    return split_checkpoint(trainer._checkpoint_connector.dump_checkpoint(weights_only=False), trainer)


def boundary_snapshot(trainer: pl.Trainer, step: int) -> BoundarySnapshot:
    """The state at a step boundary, for a survivor save: the loops (with each loader's position) and the RNG
    by value now, cheaply; the rest, with its hooks (``on_save_checkpoint``), only if a survivor save comes."""
    fit_loop = trainer.fit_loop.state_dict()
    rank_state = {"rng": capture_rng(), "combined_loader": fit_loop.get("state_dict", {}).get(LOADER_PATH[-1])}

    def shared() -> SaveState:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint["loops"] = {**checkpoint.get("loops", {}), "fit_loop": fit_loop}
        return dataclasses.replace(split_checkpoint(checkpoint, trainer), rank_state=rank_state)

    return BoundarySnapshot(step, rank_state, shared)


def is_fitting(trainer: pl.Trainer | None) -> bool:
    """Whether ``trainer`` is inside ``fit()``: saves are asynchronous there, with a next step to overlap with."""
    return (
        trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
    )


def log_to(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Every logger, at the step Lightning's own rows of this moment use (LearningRateMonitor's way)."""
    if not trainer.is_global_zero or not trainer.loggers:
        return
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
