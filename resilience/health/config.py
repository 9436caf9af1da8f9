"""Settings of GPU-health monitoring and preemption handling, checked when they are made.

Exit codes: a stop after a fault or a preemption exits non-zero, because elastic agents (torchrun,
``accelerate launch``) restart a worker group only when a worker fails, and a worker that exits 0 mid-run
makes its peers fail instead. The two codes differ so that a scheduler-side wrapper (``srun`` runs the
workers directly) can requeue a preempted job as is, and requeue a job on a faulty GPU elsewhere:

* ``EXIT_CODE_PREEMPTED = 75``: ``EX_TEMPFAIL`` of sysexits.h, "temporary failure, try again".
* ``EXIT_CODE_GPU_FAULT = 69``: ``EX_UNAVAILABLE``, "a required resource is unavailable".

Both stay clear of 1 (any uncaught exception), 2 (usage errors), 126-127 (shell) and 128+N (killed by
signal N), so a wrapper never mistakes a crash or a kill for a clean stop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from resilience.errors import ConfigError
from resilience.health.faults import FaultTable
from resilience.health.injection import ENV_VAR, Injection, parse_injections
from resilience.health.signals import parse_signal

EXIT_CODE_PREEMPTED = 75
EXIT_CODE_GPU_FAULT = 69


@dataclass
class HealthConfig:
    """How the health guard watches, decides and stops.

    Args:
        nvml: Watch GPUs through NVML (nvidia-ml-py). Without it, or without a driver, only signals and the
            hang watchdog work (one notice says so).
        devices: NVML indices or UUIDs this rank watches (default: LOCAL_RANK's entry of
            CUDA_VISIBLE_DEVICES; see :func:`~resilience.health.nvml.default_devices`).
        poll_interval_s: Seconds between reads of ECC counters, remapped rows, clock-event reasons and the
            recovery-action field. XID and ECC events arrive without polling.
        signals: Signals taken as preemption: SLURM, torchrun, ``accelerate launch`` and Kubernetes send
            SIGTERM, SLURM SIGUSR1 with ``--signal``, ``srun`` and a terminal's Ctrl-C SIGINT.
        chain_signals: Also call the handler that was installed for a signal before.
        fault_table: Overrides merged over the default table, e.g. ``{"xid": {"13": "fatal"}}`` (see
            :mod:`resilience.health.faults`).
        check_every_n_steps: Agree across ranks on steps that are multiples of this, or ``"auto"``: the ranks
            agree at each check when the next comes, so that checks take about 1% of the steps' time and at most
            2 s of steps (at the recent pace) pass between two; planned drills are checked at their step (see
            :mod:`~resilience.health.schedule`). Each check is one all-reduce of four int64 values on a gloo
            group.
        save_on_degraded: Also checkpoint when ranks agree on a degraded fault (training continues).
        grace_s: Seconds from the fault (a stop signal's arrival) to the process's exit, whatever storage or
            the network does: the emergency save commits locally, its upload gets what is left but
            ``exit_reserve_s``, and an ``os._exit`` with the stop's code ends whatever still holds the process at
            the end (an upload cut short is done again by the next start). The default leaves 5 s of margin in
            the 30 s that SLURM (KillWait), Kubernetes (terminationGracePeriodSeconds) and torchrun's agent give
            between SIGTERM and SIGKILL; set it below your scheduler's.
        exit_reserve_s: Seconds at the end of ``grace_s`` kept for leaving (the framework's teardown, loggers, the
            interpreter's exit) rather than for the upload.
        exit_code_preempted: Exit code after a preemption (default 75, ``EX_TEMPFAIL``).
        exit_code_gpu_fault: Exit code after a fatal fault (default 69, ``EX_UNAVAILABLE``).
        exit_timeout_s: After :meth:`HealthGuard.stop` without a stop decision (an adapter's own stop), force the
            exit (``os._exit`` with the same code) if teardown or a non-daemon thread holds the process longer than
            this; a worker that never exits stops an elastic agent from ever restarting the group. A decided stop
            is bounded by ``grace_s`` instead.
        hang_factor: Warn when a step takes longer than this times the running median (and ``hang_min_s``).
        hang_min_s: Steps shorter than this many seconds are never a hang, whatever the median.
        hang_min_samples: Steps measured before the watchdog judges.
        hang_window: Steps in the running median.
        hang_exit_s: A hang that goes on this many seconds after it was reported ends the process with
            ``exit_code_gpu_fault`` (a resource, a peer or the storage, is unavailable): after a survivor save when
            a peer is known lost, else with nothing more saved (no save can be agreed while the ranks are stuck),
            for the launcher or scheduler to restart the job from its last checkpoint. None: hangs are only
            reported. Keep it above ``resilience launch``'s ``--node-lost-s`` plus a save.
        watchdog: Run the hang watchdog.
        collective_timeout_s: Timeout of the health check's gloo group.
        inject: Planned faults in the ``RESILIENCE_INJECT`` syntax (default: that environment variable).
    """

    nvml: bool = True
    devices: Sequence[int | str] | None = None
    poll_interval_s: float = 5.0
    signals: Sequence[str | int] = ("SIGTERM", "SIGINT", "SIGUSR1")
    chain_signals: bool = False
    fault_table: Mapping[str, Any] | None = None
    check_every_n_steps: int | Literal["auto"] = "auto"
    save_on_degraded: bool = False
    grace_s: float = 25.0
    exit_reserve_s: float = 5.0
    exit_code_preempted: int = EXIT_CODE_PREEMPTED
    exit_code_gpu_fault: int = EXIT_CODE_GPU_FAULT
    exit_timeout_s: float = 60.0
    hang_factor: float = 5.0
    hang_min_s: float = 10.0
    hang_min_samples: int = 5
    hang_window: int = 100
    hang_exit_s: float | None = 60.0
    watchdog: bool = True
    collective_timeout_s: float = 600.0
    inject: str | None = field(default_factory=lambda: os.environ.get(ENV_VAR))

    def __post_init__(self) -> None:
        if self.hang_exit_s is not None and self.hang_exit_s <= 0:
            raise ConfigError(f"hang_exit_s={self.hang_exit_s}: use positive seconds, or None to only report hangs")
        for name in ("poll_interval_s", "grace_s", "exit_timeout_s", "hang_min_s", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: use a positive number of seconds")
        if not 0 <= self.exit_reserve_s < self.grace_s:
            raise ConfigError(
                f"exit_reserve_s={self.exit_reserve_s} with grace_s={self.grace_s}: keep it at 0 or more and below "
                "grace_s, or nothing is left for the emergency save's upload"
            )
        if self.check_every_n_steps != "auto" and (
            not isinstance(self.check_every_n_steps, int) or self.check_every_n_steps < 1
        ):
            raise ConfigError(
                f"check_every_n_steps={self.check_every_n_steps!r}: use a positive integer, or 'auto' (the default)"
            )
        for name in ("hang_min_samples", "hang_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: use a positive integer")
        if self.hang_factor <= 1:
            raise ConfigError(f"hang_factor={self.hang_factor}: use a factor above 1 (5 is a good start)")
        for name in ("exit_code_preempted", "exit_code_gpu_fault"):
            if not 1 <= getattr(self, name) <= 125:
                raise ConfigError(
                    f"{name}={getattr(self, name)}: use 1-125; 0 stops the restart, 126+ reads as a shell or "
                    "signal exit"
                )
        self.signal_numbers = [parse_signal(s) for s in self.signals]
        self.table = FaultTable(self.fault_table)
        self.injections: list[Injection] = parse_injections(self.inject or "")
