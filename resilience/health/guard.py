"""The step-boundary face of health monitoring: what adapters call, and what they are told to do.

Faults arrive on background threads at arbitrary moments, but a checkpoint can only be taken between steps
and only if every rank takes it at the same step. So the guard turns what this rank saw into one number,
agrees with the other ranks on the worst (one all-reduce MAX on a gloo group of its own, so it never
interleaves with the job's NCCL traffic or the checkpoint threads' groups) and answers the same
:class:`Decision` on every rank.

Typical use by an adapter::

    guard = HealthGuard(HealthConfig())          # collective under torch.distributed
    guard.start()                                # main thread: installs signal handlers
    for step in ...:
        train_step()
        decision = guard.on_step(step)
        if decision.stop:
            guard.emergency_save(manager, step, state, rank_state)
            guard.stop()                          # exits with decision.exit_code
        elif decision.save:
            manager.save(step, state, rank_state)
    guard.close()
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist

from resilience import leaving
from resilience.dist import Channel, is_distributed
from resilience.errors import ConfigError
from resilience.health.config import HealthConfig
from resilience.health.emergency import EmergencySave, StopDeadline, emergency_save
from resilience.health.events import EventLog, Listener
from resilience.health.faults import GPU_FAULTS, FaultEvent, Severity
from resilience.health.injection import FaultInjector, Injection, parse_injections
from resilience.health.nvml import HealthMonitor, default_devices, load_nvml
from resilience.health.schedule import CheckSchedule
from resilience.health.signals import SignalWatcher, hold_exit_code
from resilience.health.simulated import SimulatedNVML
from resilience.health.watchdog import HangWatchdog

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)

# How long a step boundary waits for the monitor thread to report a fault this rank just injected, so that a
# drill's fault stops the job at the step it names (the monitor normally sees it within 0.05 s).
_INJECTED_SEEN_TIMEOUT_S = 5.0


class Action(str, Enum):
    CONTINUE = "continue"
    WARN = "warn"
    SAVE_AND_STOP = "save_and_stop"


@dataclass(frozen=True)
class Decision:
    """The same answer on every rank for one step boundary.

    Attributes:
        action: ``continue``; ``warn`` (a degraded fault somewhere; training goes on); ``save_and_stop``.
        step: The step all ranks agreed at.
        severity: The worst severity of all ranks.
        reason: This rank's fault details, or which rank reported it.
        source_rank: The (highest-numbered) rank that reported the worst severity.
        save: Checkpoint now (always with ``save_and_stop``; with ``warn`` when ``save_on_degraded``).
        exit_code: The code :meth:`HealthGuard.stop` exits with.
        fault_time: Wall-clock time of this rank's fault, or of the decision when another rank had it; the
            emergency save's grace period runs from here.
        events: This rank's events behind the decision.
        sick_ranks: Ranks whose GPU had a fatal fault: they must not be read, so their share of the emergency
            save is written by a healthy replica.
    """

    action: Action
    step: int
    severity: Severity = Severity.OK
    reason: str = ""
    source_rank: int | None = None
    save: bool = False
    exit_code: int | None = None
    fault_time: float | None = None
    events: tuple[FaultEvent, ...] = ()
    sick_ranks: tuple[int, ...] = ()

    @property
    def stop(self) -> bool:
        return self.action is Action.SAVE_AND_STOP


def signal_watcher(config: HealthConfig, events: EventLog | None = None) -> SignalWatcher:
    """The configured stop signals, ending the process with the preemption code until training begins."""
    return SignalWatcher(
        config.signal_numbers,
        events,
        config.table,
        chain=config.chain_signals,
        exit_code=config.exit_code_preempted,
        exit_timeout_s=config.grace_s,  # from the signal, as a decided stop's
    )


class HealthGuard:
    """Watches GPU health, preemption signals and step times; agrees across ranks at step boundaries.

    Construction is collective when ``torch.distributed`` is initialised with more than one rank (it creates
    the gloo group of the health check). On the main thread it also takes the stop signals over: until
    :meth:`start`, one ends the process at once with the preemption code (nothing is trained yet; a restore
    only reads). Call :meth:`start` on the main thread, :meth:`on_step` at every step boundary on every rank,
    and :meth:`close` at the end (or use ``with``).

    Args:
        config: Settings (defaults: :class:`HealthConfig`).
        nvml: Object with the ``pynvml`` module's names to use instead of the module (tests, wrappers).
        listeners: Called with every :class:`FaultEvent`, from the thread that saw it: metrics hooks.
        signals: The stop signals' watcher, if an adapter installed one before the guard could be made
            (default: :func:`signal_watcher` of ``config``).
    """

    def __init__(
        self,
        config: HealthConfig | None = None,
        *,
        nvml: Any = None,
        listeners: Iterable[Listener] = (),
        signals: SignalWatcher | None = None,
    ):
        self.config = config or HealthConfig()
        self.rank = dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0") or 0)
        self.events = EventLog(self.rank, listeners)
        timeout = timedelta(seconds=self.config.collective_timeout_s)
        self._channel = Channel(dist.new_group(backend="gloo", timeout=timeout) if is_distributed() else None)
        self.signals = signals or signal_watcher(self.config, self.events)
        self.signals.events = self.events
        self.signals.await_training()
        if threading.current_thread() is threading.main_thread():
            self.signals.install()  # from here a stop signal ends the process with the preemption code
        self.monitor: HealthMonitor | None = None
        self.watchdog: HangWatchdog | None = None
        self.stopping: Decision | None = None
        self.deadline: StopDeadline | None = None  # a decided stop's clock
        self._exit_timer: threading.Timer | None = None  # its forced exit, at the end of the grace
        # whether a survivor save is under way, which a hang past hang_exit_s waits for (the session sets it)
        self.rescue_under_way: Callable[[], bool] = lambda: False
        self._nvml = nvml
        self._injections: list[Injection] = list(self.config.injections)
        self._injector = FaultInjector([], self.rank)
        self._schedule: CheckSchedule  # by start(), which knows the drills
        self._started = False
        self._exiting = False
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------------------

    def inject(self, spec: str | Injection) -> None:
        """Plan faults (``RESILIENCE_INJECT`` syntax, or an :class:`Injection`); call before :meth:`start`."""
        if self._started:
            raise RuntimeError("inject() must come before start(): GPU faults need the NVML stand-in in place")
        self._injections += parse_injections(spec) if isinstance(spec, str) else [spec]

    def start(self) -> HealthGuard:
        """Install the signal handlers (main thread only) and start the monitor and watchdog threads."""
        if self._started:
            return self
        self._started = True
        mine = [i for i in self._injections if i.rank in (None, self.rank)]
        unwatched = [i for i in mine if i.fault == "signal" and i.value not in self.signals.signals]
        try:
            if unwatched:
                raise ConfigError(
                    f"injected {unwatched[0]} is not among the watched signals "
                    f"{[s.name for s in self.signals.signals]}; its default action would kill the process instead "
                    "of stopping it cleanly"
                )
            nvml = self._nvml if self._nvml is not None else load_nvml() if self.config.nvml else None
            simulated = self._simulated(nvml, mine)
        except ConfigError:
            self.close()  # this guard will not run: the signals taken at construction go back
            raise
        self._injector = FaultInjector(mine, self.rank, simulated)
        planned = (i.step for i in self._injections)  # every rank's drills: the plan is the same on all
        self._schedule = CheckSchedule(self.config.check_every_n_steps, planned, alone=not self._channel.active)
        self.signals.install()
        self.signals.record()  # training begins: a signal now stops it at the next step boundary, with a save
        if self.config.nvml:
            devices = list(self.config.devices) if self.config.devices is not None else default_devices()
            self.monitor = HealthMonitor(
                simulated or nvml, self.events, self.config.table, devices, poll_interval_s=self.config.poll_interval_s
            )
            if not self.monitor.start() and simulated is not None:
                self.close()
                raise ConfigError(f"GPU faults are injected ({mine}) but the NVML monitor could not start (see log)")
        if self.config.watchdog:
            self.watchdog = HangWatchdog(
                self.events,
                self.config.table,
                factor=self.config.hang_factor,
                min_s=self.config.hang_min_s,
                min_samples=self.config.hang_min_samples,
                window=self.config.hang_window,
                stuck_s=self.config.hang_exit_s,
                on_stuck=self._stuck,
            )
            self.watchdog.start()
        return self

    def _stuck(self, elapsed: float, step: int) -> None:
        """From the watchdog: a hang went on ``hang_exit_s`` past its report. Unless a survivor save is under way
        (it saves and leaves by itself) or a stop is (its own clock ends it), the process leaves now, with the
        fault code: no save can be agreed while ranks are stuck, and a restart from the last checkpoint beats a
        wait for a collective that may never end (gloo's default timeout is 30 minutes, NCCL's 10)."""
        if self.stopping is not None or self.rescue_under_way():
            return
        code = self.config.exit_code_gpu_fault
        log.error(
            "rank %d: stuck for %.0f s in the step after step %d, %.0f s past the hang report (hang_exit_s): a peer "
            "that does not answer, storage that stopped, or a store that never replies. Nothing more can be saved "
            "while the ranks are stuck: exiting with code %d, for a restart from the last checkpoint",
            self.rank,
            elapsed,
            step,
            self.config.hang_exit_s or 0.0,
            code,
        )
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)

    def _simulated(self, nvml: Any, mine: list[Injection]) -> SimulatedNVML | None:
        """The NVML stand-in GPU faults are injected into, or None when none are planned for this rank."""
        if not any(i.kind is not None for i in mine):
            return None
        if not self.config.nvml:
            raise ConfigError(f"GPU faults are injected ({mine}) but HealthConfig.nvml is False")
        if nvml is None:
            raise ConfigError(
                "GPU fault injection needs nvidia-ml-py, a dependency of the pack: pip install nvidia-ml-py"
            )
        return nvml if isinstance(nvml, SimulatedNVML) else SimulatedNVML(nvml, passthrough=True)

    def close(self) -> None:
        """Stop the threads and give back the signal handlers (kept while :meth:`stop` exits)."""
        if self._closed:
            return
        self._closed = True
        if not self._exiting:
            if self._exit_timer is not None:  # a decided stop its caller did not carry out: the process stays
                self._exit_timer.cancel()
                leaving.cancel()
            self.signals.restore()
            # A framework may put the watcher's handler back later (Lightning does at the end of a fit): it then
            # passes signals on, and must not keep this run's listeners (the session, the Trainer) alive.
            self.signals.events = EventLog(self.rank)
        if self.monitor is not None:
            self.monitor.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self._channel.group is not None:
            dist.destroy_process_group(self._channel.group)
            self._channel = Channel(None)

    def __enter__(self) -> HealthGuard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- step boundary -------------------------------------------------------------------------------------

    def on_step(self, step: int) -> Decision:
        """Call at every step boundary on every rank, with the same ``step``; collective on checked steps
        (:mod:`~resilience.health.schedule` says which)."""
        if not self._started or self._closed:
            raise RuntimeError("HealthGuard.on_step() needs start() first (and no close() yet)")
        self.events.step = step
        if self.watchdog is not None:
            self.watchdog.on_step(step)
        before = len(self.events)
        kinds = {i.kind for i in self._injector.fire(step) if i.kind is not None}
        if kinds and not self.events.wait_for(kinds, before, _INJECTED_SEEN_TIMEOUT_S):
            log.warning(
                "rank %d: the monitor did not report the injected %s within %.0f s",
                self.rank,
                sorted(k.value for k in kinds),
                _INJECTED_SEEN_TIMEOUT_S,
            )
        self.signals.drain()
        if not self._schedule.due(step):
            return Decision(Action.CONTINUE, step)
        return self._decide(step)

    def _decide(self, step: int) -> Decision:
        unhandled = self.events.unhandled()
        local = max((e.severity for e in unhandled), default=Severity.OK)
        # One all-reduce: the worst severity with the rank that has it, the step range to catch adapters that
        # call on_step with different steps on different ranks, and the fewest steps any rank lets pass before
        # the next check.
        start = time.perf_counter()
        proposal = self._schedule.proposal(step, start)
        code, highest, negated_lowest, negated_steps = self._channel.max(
            [int(local) << 32 | self.rank, step, -step, -proposal]
        )
        self._schedule.agreed(step, -negated_steps, time.perf_counter() - start)
        if highest != -negated_lowest:
            raise RuntimeError(
                f"ranks called on_step with different steps ({-negated_lowest} to {highest}); the health check "
                "must run at the same step on every rank"
            )
        severity, source = Severity(code >> 32), code & 0xFFFFFFFF
        if severity is Severity.OK:
            return Decision(Action.CONTINUE, step)
        mine = tuple(e for e in unhandled if e.severity == severity)
        reason = "; ".join(e.detail for e in mine) or f"rank {source} reported a {severity.name.lower()} fault"
        if severity < Severity.PREEMPTION:
            self.events.consume_below(Severity.PREEMPTION)
            if self.rank == 0:
                log.warning("degraded fault at step %d (rank %d): %s; training continues", step, source, reason)
            return Decision(Action.WARN, step, severity, reason, source, save=self.config.save_on_degraded, events=mine)
        exit_code = (
            self.config.exit_code_preempted if severity is Severity.PREEMPTION else self.config.exit_code_gpu_fault
        )
        fault_time = min((e.time for e in mine), default=time.time())
        sick_here = any(e.severity is Severity.FATAL and e.kind in GPU_FAULTS for e in unhandled)
        sick = tuple(r for r, flag in enumerate(self._channel.all_gather(sick_here)) if flag)
        decision = Decision(
            Action.SAVE_AND_STOP, step, severity, reason, source, True, exit_code, fault_time, mine, sick
        )
        if self.stopping is None:
            self.stopping = decision
            log.error("rank %d: all ranks save step %d and stop (exit code %d): %s", self.rank, step, exit_code, reason)
            self._arm(fault_time, exit_code)
        return decision

    def _arm(self, fault_time: float, exit_code: int) -> None:
        """From the stop decision on, one clock (:class:`StopDeadline`): the process is gone ``grace_s`` after the
        fault whatever holds it, and the stop's own work (the emergency save, its upload) is no hang."""
        self.deadline = StopDeadline(fault_time, self.config.grace_s, self.config.exit_reserve_s)
        if self.watchdog is not None:
            self.watchdog.close()
        grace = f"at the end of the {self.config.grace_s:g} s grace from the fault"
        self._exit_timer = hold_exit_code(self.signals.signals, exit_code, self.deadline.exit_left(), when=grace)

    def emergency_save(
        self,
        manager: CheckpointManager,
        step: int,
        state: Any = None,
        rank_state: Any = None,
        *,
        save: Callable[[], object] | None = None,
    ) -> EmergencySave:
        """:func:`emergency_save` with the configured grace period, counted from this rank's fault."""
        fault_time = self.stopping.fault_time if self.stopping is not None else None
        work_s = self.config.grace_s - self.config.exit_reserve_s  # the rest of the grace is for leaving
        return emergency_save(manager, step, state, rank_state, grace_s=work_s, fault_time=fault_time, save=save)

    def stop(self, exit_code: int | None = None) -> NoReturn:
        """Leave the process with ``exit_code`` (default: the stop decision's) so a launcher restarts it.

        Raises SystemExit, so ``finally`` blocks and framework teardown run. A timer forces the same exit code
        with ``os._exit`` if the process is still alive at the end of the stop's grace (armed at the decision),
        or ``exit_timeout_s`` later without one (a hung teardown, upload or non-daemon thread would otherwise
        keep an elastic agent from restarting, or outlast the scheduler's grace). The stop
        signals are ignored from here on, so neither a second SIGTERM during teardown nor a launcher's closing
        one during interpreter shutdown can change the exit code (:func:`hold_exit_code`).
        """
        if exit_code is None:
            if self.stopping is None or self.stopping.exit_code is None:
                raise ValueError("no stop decision yet: pass the exit code to stop() explicitly")
            exit_code = self.stopping.exit_code
        self._exiting = True
        self.close()
        log.warning("rank %d: exiting with code %d for the launcher to restart or requeue", self.rank, exit_code)
        if self.deadline is None:  # a decided stop's exit is armed already, for the end of its grace
            hold_exit_code(self.signals.signals, exit_code, self.config.exit_timeout_s)
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(exit_code)

    # ---- for adapters and metrics --------------------------------------------------------------------------

    @property
    def planned(self) -> tuple[Injection, ...]:
        """Every planned fault (the config's, ``RESILIENCE_INJECT`` and :meth:`inject`'s), all ranks': a slow rank's
        drill is fired by the session's straggler part, not here."""
        return tuple(self._injections)

    def add_listener(self, listener: Listener) -> None:
        self.events.listeners.append(listener)

    def paused(self) -> AbstractContextManager[None]:
        """Wrap work between steps that is not a step (validation, a blocking save) so it is not a hang."""
        return self.watchdog.suspended() if self.watchdog is not None else nullcontext()
