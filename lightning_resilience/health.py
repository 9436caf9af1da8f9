"""``HealthGuardCallback``: on a fatal GPU fault or a preemption, every rank saves the same step and stops."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl

from lightning_resilience.session_callback import SessionCallback
from resilience import env_settings as env
from resilience.docstrings import documented_by
from resilience.health import EmergencySave, HealthConfig, SignalWatcher, signal_watcher
from resilience.session import TrainingSession


@documented_by(HealthConfig)
class HealthGuardCallback(SessionCallback):
    """Watches NVML, preemption signals and hangs; at a step boundary all ranks agree, save, commit and exit.

    A fatal fault (e.g. XID 79, a double-bit ECC error, a lost GPU) or a preemption signal (SIGTERM, SIGUSR1)
    seen by any rank makes every rank save the same step, commit it locally, upload it in what is left of
    ``grace_s`` from the fault, and exit within that grace with code 69 (GPU fault) or 75 (preemption), which
    torchrun's ``--max_restarts`` or a SLURM requeue turns into a restart that resumes at that step. Degraded
    faults (thermal slowdown, pending row remaps, a hang warning) are logged and counted. Faults can be
    injected for drills with ``RESILIENCE_INJECT`` (see docs/HEALTH.md). It replaces Lightning's own SIGTERM
    handling for the run (which stops without saving). From its construction until training begins (the
    launch, a restore), a stop signal ends the process at once with the preemption code: nothing is trained
    yet. Every argument is a :class:`HealthConfig` field.

    Args:
        grace_s: Seconds from the fault (a stop signal's arrival) to the process's exit, whatever storage or the
            network does: the emergency save commits locally, its upload gets what is left but ``exit_reserve_s``,
            and an ``os._exit`` with the stop's code ends whatever still holds the process at the end (an upload cut
            short is done again by the next start). The default leaves 5 s of margin in the 30 s that SLURM
            (KillWait), Kubernetes (terminationGracePeriodSeconds) and torchrun's agent give between SIGTERM and
            SIGKILL; set it below your scheduler's.
        exit_reserve_s: Seconds at the end of ``grace_s`` kept for leaving (the framework's teardown, loggers, the
            interpreter's exit) rather than for the upload.
        check_every_n_steps: Agree across ranks on steps that are multiples of this, or ``"auto"``: the ranks agree
            at each check when the next comes, so that checks take about 1% of the steps' time and at most 2 s of
            steps (at the recent pace) pass between two; planned drills are checked at their step (see
            :mod:`~resilience.health.schedule`). Each check is one all-reduce of four int64 values on a gloo group.
        save_on_degraded: Also checkpoint when ranks agree on a degraded fault (training continues).
        nvml: Watch GPUs through NVML (nvidia-ml-py). Without it, or without a driver, only signals and the hang
            watchdog work (one notice says so).
        devices: NVML indices or UUIDs this rank watches (default: LOCAL_RANK's entry of CUDA_VISIBLE_DEVICES; see
            :func:`~resilience.health.nvml.default_devices`).
        poll_interval_s: Seconds between reads of ECC counters, remapped rows, clock-event reasons and the
            recovery-action field. XID and ECC events arrive without polling.
        signals: Signals taken as preemption: SLURM, torchrun, ``accelerate launch`` and Kubernetes send SIGTERM,
            SLURM SIGUSR1 with ``--signal``, ``srun`` and a terminal's Ctrl-C SIGINT.
        fault_table: Overrides merged over the default table, e.g. ``{"xid": {"13": "fatal"}}`` (see
            :mod:`resilience.health.faults`).
        watchdog: Run the hang watchdog.
        hang_factor: Warn when a step takes longer than this times the running median (and ``hang_min_s``).
        hang_min_s: Steps shorter than this many seconds are never a hang, whatever the median.
        hang_min_samples: Steps measured before the watchdog judges.
        hang_window: Steps in the running median.
        hang_exit_s: A hang that goes on this many seconds after it was reported ends the process with
            ``exit_code_gpu_fault`` (a resource, a peer or the storage, is unavailable): after a survivor save when
            a peer is known lost, else with nothing more saved (no save can be agreed while the ranks are stuck),
            for the launcher or scheduler to restart the job from its last checkpoint. None: hangs are only
            reported. Keep it above ``resilience launch``'s ``--node-lost-s`` plus a save.
        exit_code_preempted: Exit code after a preemption (default 75, ``EX_TEMPFAIL``).
        exit_code_gpu_fault: Exit code after a fatal fault (default 69, ``EX_UNAVAILABLE``).
        exit_timeout_s: After :meth:`HealthGuard.stop` without a stop decision (an adapter's own stop), force the
            exit (``os._exit`` with the same code) if teardown or a non-daemon thread holds the process longer than
            this; a worker that never exits stops an elastic agent from ever restarting the group. A decided stop is
            bounded by ``grace_s`` instead.
        inject: Planned faults in the ``RESILIENCE_INJECT`` syntax (default: that environment variable).
    """

    def __init__(
        self,
        grace_s: float = 25.0,
        exit_reserve_s: float = 5.0,
        check_every_n_steps: int | Literal["auto"] = "auto",
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
        hang_exit_s: float | None = 60.0,
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
