"""``GoodputMonitor``: where the run's time goes (across restarts), data starvation, checkpoint telemetry."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from lightning_resilience.health import HealthGuardCallback
from resilience.goodput import CheckpointTelemetry, DataWaitMonitor, GoodputLedger
from resilience.goodput.data import batch_size_of


class GoodputMonitor(Callback):
    """Keeps the goodput ledger of the run and logs data-wait and checkpoint metrics to the Trainer's loggers.

    Lightning has no hook around the data loader's ``next()``; the time between one step's end and the next
    step's start is the fetch and host-to-device copy plus whatever callbacks and validation did in between.
    This callback measures that gap and takes out what it knows is not data: the time saves blocked (from
    :class:`ResilientCheckpointIO`) and validation. ``resilience report RUN_DIR`` reads the ledger.

    Args:
        run_dir: Where the ledger lives (``<run_dir>/goodput/``); default ``trainer.default_root_dir``. It must
            outlive a restart: on multi-node jobs use a shared file system.
        window_steps: Steps per data-wait window (one metrics row and at most one starvation warning each).
        starvation_threshold: Fraction of step time waiting for data above which the accelerator is starving.
    """

    def __init__(self, run_dir: str | None = None, window_steps: int = 50, starvation_threshold: float = 0.05) -> None:
        self.run_dir = run_dir
        self.window_steps = window_steps
        self.starvation_threshold = starvation_threshold
        self.ledger: GoodputLedger | None = None
        self.data: DataWaitMonitor | None = None
        self.telemetry: CheckpointTelemetry | None = None
        self._io: ResilientCheckpointIO | None = None
        self._end_t: float | None = None
        self._start_t: float | None = None
        self._stall_seen = 0.0
        self._not_data_s = 0.0
        self._val_t: float | None = None
        self._wait_s = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.ledger is not None:
            return
        run_dir = self.run_dir or trainer.default_root_dir
        self.ledger = GoodputLedger(run_dir, rank=trainer.global_rank)
        self.data = DataWaitMonitor(self.window_steps, self.starvation_threshold, rank=trainer.global_rank)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, ResilientCheckpointIO):
            self._io = io
            self.telemetry = CheckpointTelemetry(ledger=self.ledger)
            io.listeners.append(self.telemetry)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.ledger is not None and self.data is not None
        restore = self._io.last_restore if self._io is not None else None
        self.ledger.restored(*(restore if restore is not None else (None, 0.0)))
        self.ledger.startup_done()
        if trainer.train_dataloader is not None:
            self.data.watch(trainer.train_dataloader)
        self._stall_seen = self._io.stall_s if self._io is not None else 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        assert self.ledger is not None
        now = time.perf_counter()
        stall = self._take_stall()
        if stall > 0:
            self.ledger.checkpoint_stall(stall, trainer.global_step)
        self._wait_s = 0.0
        if self._end_t is not None:
            self._wait_s = max(0.0, now - self._end_t - stall - self._not_data_s)
            self.ledger.data_wait(self._wait_s)
        self._not_data_s = 0.0
        self.ledger.step_begin()
        if self._start_t is not None and self.data is not None:
            window = self.data.record(self._wait_s, now - self._start_t, batch_size_of(batch))
            if window is not None:
                self._log(trainer, {**window.metrics(), **self.ledger.metrics()})
        self._start_t = now

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        assert self.ledger is not None
        self.ledger.step_end(trainer.global_step)
        if self.telemetry is not None:
            for metrics in self.telemetry.drain():
                self._log(trainer, metrics)
        self._end_t = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_t = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_t is not None:
            self._not_data_s += time.perf_counter() - self._val_t
            self._val_t = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, "completed")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        assert self.ledger is not None
        guard = next((cb for cb in trainer.callbacks if isinstance(cb, HealthGuardCallback)), None)  # type: ignore[attr-defined]
        if guard is not None and guard.last_decision is not None:
            self.ledger.fault(guard.last_decision.reason, guard.last_decision.step)
        emergency = guard.last_emergency if guard is not None else None
        if emergency is not None and emergency.fault_to_local_s is not None:
            self.ledger.emergency(emergency.fault_to_local_s, f"emergency save of step {emergency.step}")
        self._finish(trainer, f"{type(exception).__name__}: {exception}"[:200])

    def _finish(self, trainer: pl.Trainer, reason: str) -> None:
        if self.ledger is None:
            return
        stall = self._take_stall()
        if stall > 0:
            self.ledger.checkpoint_stall(stall, trainer.global_step)
        self.ledger.end(reason)
        if self.telemetry is not None:
            self.telemetry.close()
        self.ledger = None

    def _take_stall(self) -> float:
        if self._io is None:
            return 0.0
        stall, self._stall_seen = self._io.stall_s - self._stall_seen, self._io.stall_s
        return stall

    def _log(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(metrics, step=trainer.global_step)
