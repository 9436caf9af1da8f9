"""``HealthGuardCallback``: on a fatal GPU fault or a preemption, every rank saves the same step and stops."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl

from lightning_resilience.session_callback import SessionCallback
from resilience import env_settings as env
from resilience.docstrings import document
from resilience.health import EmergencySave, HealthConfig, SignalWatcher, signal_watcher
from resilience.session import TrainingSession


@document(HealthConfig)
class HealthGuardCallback(SessionCallback):
    """Watches NVML, preemption signals and hangs; at a step boundary all ranks agree, save, commit and exit.

    A fatal fault (e.g. XID 79, a double-bit ECC error, a lost GPU) or a preemption signal (SIGTERM, SIGUSR1)
    seen by any rank makes every rank save the same step, wait for the local commit within ``grace_s`` of the
    fault (the upload gets what time is left), and exit with code 69 (GPU fault) or 75 (preemption), which
    torchrun's ``--max_restarts`` or a SLURM requeue turns into a restart that resumes at that step. Degraded
    faults (thermal slowdown, pending row remaps, a hang warning) are logged and counted. Faults can be
    injected for drills with ``RESILIENCE_INJECT`` (see docs/HEALTH.md). It replaces Lightning's own SIGTERM
    handling for the run (which stops without saving). From its construction until training begins (the
    launch, a restore), a stop signal ends the process at once with the preemption code: nothing is trained
    yet. Every argument is a :class:`HealthConfig` field.
    """

    def __init__(
        self,
        grace_s: float = 25.0,
        check_every_n_steps: int = 1,
        save_on_degraded: bool = False,
        nvml: bool = True,
        devices: Sequence[int | str] | None = None,
        poll_interval_s: float = 5.0,
        signals: Sequence[str] = ("SIGTERM", "SIGINT", "SIGUSR1"),
        fault_table: dict[str, Any] | None = None,
        watchdog: bool = True,
        hang_factor: float = 5.0,
        hang_min_s: float = 10.0,
        hang_min_samples: int = 5,
        hang_window: int = 100,
        exit_code_preempted: int = 75,
        exit_code_gpu_fault: int = 69,
        exit_timeout_s: float = 60.0,
        inject: str | None = None,
    ) -> None:
        self.config = env.pick(HealthConfig, locals(), signals=tuple(signals))  # None: HealthConfig's default
        self.last_emergency: EmergencySave | None = None
        self._signals: SignalWatcher | None = None
        if threading.current_thread() is threading.main_thread():
            self._signals = signal_watcher(self.config)  # the session's guard gives it its event log
            self._signals.install()

    def configure(self, session: TrainingSession, trainer: pl.Trainer) -> None:
        session.use_health(self.config, signals=self._signals)  # collective: the agreement's gloo group

    def keep_after_fit(self, session: TrainingSession) -> None:
        self.last_emergency = session.last_emergency
