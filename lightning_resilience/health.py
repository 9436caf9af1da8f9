"""``HealthGuardCallback``: on a fatal GPU fault or a preemption, every rank saves the same step and stops."""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from resilience.health import Action, Decision, EmergencySave, FaultEvent, HealthConfig, HealthGuard

log = logging.getLogger(__name__)


class HealthGuardCallback(Callback):
    """Watches NVML and preemption signals; at a step boundary all ranks agree, save, commit and exit.

    A fatal fault (e.g. XID 79, a double-bit ECC error, a lost GPU) or a preemption signal (SIGTERM, SIGUSR1)
    seen by any rank makes every rank save the same step through :class:`ResilientCheckpointIO`, wait for
    the local commit within ``grace_s`` of the fault (the upload gets what time is left), and exit with
    code 69 (GPU fault) or 75 (preemption), which torchrun's ``--max_restarts`` or a SLURM requeue turns into
    a restart that resumes at that step. Degraded faults (thermal slowdown, pending row remaps) are logged
    and counted. Faults can be injected for drills with ``RESILIENCE_INJECT`` (see docs/HEALTH.md).

    It replaces Lightning's own SIGTERM handling for the run (which stops without saving).

    Args:
        grace_s: Seconds from the fault until the process must be on its way out.
        check_every_n_steps: Agree across ranks every this many steps (one tiny all-reduce each).
        save_on_degraded: Also save (without stopping) when ranks agree on a degraded fault.
        nvml: Watch GPUs through NVML; without a driver only signals and the hang watchdog work.
        signals: Signals treated as preemption.
        fault_table: Overrides of the fault table, e.g. ``{"xid": {"13": "fatal"}}``.
        hang_factor: Warn when a step takes this many times the running median (and at least ``hang_min_s``).
        hang_min_s: See ``hang_factor``.
        exit_code_preempted: Exit code after a preemption.
        exit_code_gpu_fault: Exit code after a fatal fault.
        inject: Faults to inject, in ``RESILIENCE_INJECT`` syntax (default: that environment variable).
    """

    def __init__(
        self,
        grace_s: float = 25.0,
        check_every_n_steps: int = 1,
        save_on_degraded: bool = False,
        nvml: bool = True,
        signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
        fault_table: dict[str, Any] | None = None,
        hang_factor: float = 5.0,
        hang_min_s: float = 10.0,
        exit_code_preempted: int = 75,
        exit_code_gpu_fault: int = 69,
        inject: str | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {"inject": inject} if inject is not None else {}
        self.config = HealthConfig(
            nvml=nvml,
            signals=signals,
            fault_table=fault_table,
            check_every_n_steps=check_every_n_steps,
            save_on_degraded=save_on_degraded,
            grace_s=grace_s,
            exit_code_preempted=exit_code_preempted,
            exit_code_gpu_fault=exit_code_gpu_fault,
            hang_factor=hang_factor,
            hang_min_s=hang_min_s,
            **kwargs,
        )
        self.guard: HealthGuard | None = None
        self.last_emergency: EmergencySave | None = None
        self.last_decision: Decision | None = None
        self._events: list[FaultEvent] = []
        self._paused: AbstractContextManager[None] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.guard is None:
            self.guard = HealthGuard(self.config, listeners=[self._events.append])  # collective

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning installed its signal handlers, so ours take SIGTERM for this run
        assert self.guard is not None
        self.guard.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is None or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # only at optimizer-step boundaries: a save mid-accumulation would lose gradients
        step = trainer.global_step
        decision = self.guard.on_step(step)
        self._log_events(trainer)
        if decision.action is Action.WARN and decision.save:
            trainer.save_checkpoint(self._path(trainer, "degraded", step), weights_only=False)
        if not decision.stop:
            return
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, ResilientCheckpointIO):
            raise TypeError("HealthGuardCallback saves through ResilientCheckpointIO: add it to the Trainer's plugins")
        path = self._path(trainer, "emergency", step)
        self.last_emergency = self.guard.emergency_save(
            io.manager, step, save=lambda: trainer.save_checkpoint(path, weights_only=False)
        )
        if trainer.logger is not None and trainer.is_global_zero:
            result = self.last_emergency
            metrics = {"health/emergency_local_committed": float(result.local_committed)}
            if result.fault_to_local_s is not None:
                metrics["health/fault_to_commit_s"] = result.fault_to_local_s
            trainer.logger.log_metrics(metrics, step=step)
            trainer.logger.save()
        self.guard.stop()

    def _path(self, trainer: pl.Trainer, kind: str, step: int) -> str:
        io = trainer.strategy.checkpoint_io
        root = io.config.local_root if isinstance(io, ResilientCheckpointIO) else trainer.default_root_dir
        return os.path.join(root, f"{kind}-step={step}.ckpt")

    def _log_events(self, trainer: pl.Trainer) -> None:
        if not self._events:
            return
        events, self._events[:] = list(self._events), []
        if trainer.logger is not None and trainer.is_global_zero:
            counts: dict[str, float] = {}
            for event in events:
                key = f"health/{event.severity.name.lower()}_events"
                counts[key] = counts.get(key, 0.0) + 1
            trainer.logger.log_metrics(counts, step=trainer.global_step)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None and trainer.training:
            self._paused = self.guard.paused()  # validation is not a hung training step
            self._paused.__enter__()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._paused is not None:
            self._paused.__exit__(None, None, None)
            self._paused = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.guard is not None and stage == "fit":
            self.guard.close()
            self.guard = None
