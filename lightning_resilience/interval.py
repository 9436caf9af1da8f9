"""``PeriodicCheckpoint``: save every N steps, or every ``"auto"`` steps from Young/Daly."""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from resilience.goodput import AdaptiveInterval


class PeriodicCheckpoint(Callback):
    """Saves through :class:`ResilientCheckpointIO` at a fixed step interval, or at the one that wastes least.

    With ``every_n_steps="auto"`` the interval is about ``sqrt(2 * C * MTBF)`` (Young/Daly), where ``C`` is the
    measured time a save blocks training (the median of recent saves) and MTBF is given, observed from the
    run's restarts in its goodput ledger, or a prior per GPU; it is clamped to
    ``[min_interval_s, max_interval_s]`` and turned into steps with the measured step time. Rank 0 decides and
    broadcasts the interval, so every rank saves at the same step. The plan (interval, expected overhead and
    expected lost work per failure) is logged after each save.

    Args:
        every_n_steps: Steps between saves, or ``"auto"``.
        mtbf_hours: Mean time between failures of the whole job, if known.
        min_interval_s: Shortest interval ``"auto"`` may choose.
        max_interval_s: Longest interval ``"auto"`` may choose.
        warmup_steps: With ``"auto"``, the first save comes after this many steps, to measure its cost.
        run_dir: Goodput ledger location for the observed MTBF (default: ``trainer.default_root_dir``).
    """

    def __init__(
        self,
        every_n_steps: int | Literal["auto"] = "auto",
        mtbf_hours: float | None = None,
        min_interval_s: float = 60.0,
        max_interval_s: float = 6 * 3600.0,
        warmup_steps: int = 5,
        run_dir: str | None = None,
    ) -> None:
        if every_n_steps != "auto" and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"every_n_steps={every_n_steps!r}: use a positive number of steps or 'auto'")
        self.every_n_steps = every_n_steps
        self.mtbf_hours = mtbf_hours
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.warmup_steps = warmup_steps
        self.run_dir = run_dir
        self.planner: AdaptiveInterval | None = None
        self.last_plan: dict[str, Any] | None = None
        self._next_step = 0
        self._step_times: deque[float] = deque(maxlen=50)
        self._last_end: float | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.every_n_steps != "auto":
            return
        self.planner = AdaptiveInterval(
            mtbf_s=None if self.mtbf_hours is None else self.mtbf_hours * 3600.0,
            world_size=trainer.world_size,
            min_s=self.min_interval_s,
            max_s=self.max_interval_s,
        )
        self.planner.observe_ledger(self.run_dir or trainer.default_root_dir)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        first = self.warmup_steps if self.every_n_steps == "auto" else self.every_n_steps
        self._next_step = trainer.global_step + int(first)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._step_times.append(now - self._last_end)
        self._last_end = now
        if (batch_idx + 1) % trainer.accumulate_grad_batches or trainer.global_step < self._next_step:
            return
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, ResilientCheckpointIO):
            raise TypeError("PeriodicCheckpoint saves through ResilientCheckpointIO: add it to the Trainer's plugins")
        before = io.stall_s
        # one name for all periodic saves: it protects only the newest, and retention handles the rest
        trainer.save_checkpoint(os.path.join(io.config.local_root, "periodic.ckpt"), weights_only=False)
        self._next_step = trainer.global_step + self._interval_steps(trainer, io.stall_s - before)
        self._last_end = time.perf_counter()  # the save is not part of the next step's time

    def _interval_steps(self, trainer: pl.Trainer, cost_s: float) -> int:
        if self.planner is None:
            return int(self.every_n_steps)
        self.planner.observe_cost(cost_s)
        plan = self.planner.plan(step_s=statistics.median(self._step_times) if self._step_times else None)
        steps = trainer.strategy.broadcast(plan.interval_steps or self.warmup_steps)  # same on every rank
        self.last_plan = plan.to_dict()
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(plan.metrics(int(steps)), step=trainer.global_step)
        return int(steps)
