"""The training session: everything the pack does at a step boundary, once, for every framework.

A framework adapter keeps three parts only: it builds the state to save (:data:`StateBuilder`), it wires the
framework's hooks to the session's calls, and it gives the session a metrics sink (its loggers or trackers).
The session owns the rest:

* saves on a fixed interval or on the Young/Daly one (``"auto"``), planned on rank 0 and agreed by all;
* health: at each boundary the ranks agree on faults and preemption signals; a stop is an emergency save
  within the grace period, returned to the adapter as a :class:`Boundary` with the exit code (never raised
  from inside a framework's data loader);
* goodput: the time saves blocked training (their staging waits before an optimizer step included), data
  waits, restores and emergencies go to the ledger; per-save telemetry and data-wait windows to the sinks;
* the saved RNG streams, re-applied where the saved run stood.

Call order on every rank::

    restored = session.restore(target)     # a resume (optional); then session.restored(restored)
    session.start(step)                    # training begins (collective: claims the checkpoint root)
    loop: session.step_begin(); ...; boundary = session.step_end(step)  # collective
          if boundary.stop: leave the loop
    session.end(reason)                    # waits for the last saves; exits with the stop's code if stopped
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NoReturn, TypeVar

from resilience.checkpoint import rng
from resilience.checkpoint.loader import Restored
from resilience.checkpoint.manager import CheckpointManager
from resilience.checkpoint.rng import restore_rng
from resilience.checkpoint.save_handle import SaveHandle
from resilience.config import WhenBusy
from resilience.errors import ConfigError
from resilience.goodput import (
    AdaptiveInterval,
    CheckpointTelemetry,
    DataWaitMonitor,
    DataWindow,
    GoodputLedger,
    TimedIterator,
)
from resilience.goodput.ledger import COMPLETED, incarnation_start, ledger_dir
from resilience.goodput.summary import GoodputSummary, summarize
from resilience.health import (
    Decision,
    EmergencySave,
    FaultEvent,
    HealthConfig,
    HealthGuard,
    Kind,
    Severity,
    SignalWatcher,
)
from resilience.health.faults import GPU_FAULTS
from resilience.health.injection import ENV_VAR as INJECT_ENV_VAR
from resilience.recovery import inplace
from resilience.recovery.liveness import Notice
from resilience.recovery.peer_loss import BoundaryBuilder, BoundarySnapshot, PeerLossConfig, PeerLossWatch
from resilience.recovery.survivors import SurvivorOutcome

log = logging.getLogger(__name__)
MetricsSink = Callable[[dict[str, float]], None]
FAILED_DRAIN_S = 30.0  # after a failure, how long the last saves may still take before the session ends
FAILED_EXIT_WAIT_S = 5.0  # ... and how long the process exit then waits for them
T = TypeVar("T")
RngTiming = Literal["now", "start", "next_batch"]


@dataclass(frozen=True)
class SaveState:
    """What the adapter hands the engine for one save: the shared tree, this rank's tree, manifest extras, and
    which top-level keys of the shared tree every rank holds alike (None: all; see ``CheckpointManager.save``)."""

    state: Any
    rank_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    replicated: tuple[str, ...] | None = None
    record_crcs: bool = False  # a framework file will be copied from this save (see CheckpointManager.save)


StateBuilder = Callable[[int], SaveState]


@dataclass
class IntervalConfig:
    """When the session saves on its own.

    Attributes:
        every_n_steps: Save every N optimizer steps (at steps that are multiples of N), ``"auto"`` for the
            Young/Daly interval ``sqrt(2 * C * MTBF)`` from the measured blocking cost C of a save, or None for
            no interval saves.
        mtbf_hours: With ``"auto"``: the job's mean time between failures, if known; else observed from the run's
            restarts in its goodput ledger, else a prior of 5.8 GPU-years per GPU.
        min_interval_s: With ``"auto"``: the shortest interval it may choose.
        max_interval_s: With ``"auto"``: the longest interval it may choose.
        warmup_steps: With ``"auto"``: the first save comes this many steps in, to measure what a save costs.
    """

    every_n_steps: int | Literal["auto"] | None = None
    mtbf_hours: float | None = None
    min_interval_s: float = 60.0
    max_interval_s: float = 6 * 3600.0
    warmup_steps: int = 5

    def __post_init__(self) -> None:
        every = self.every_n_steps
        if (
            every is not None
            and every != "auto"
            and (isinstance(every, bool) or not isinstance(every, int) or every < 1)
        ):
            raise ConfigError(f"every_n_steps={every!r}: use a positive number of optimizer steps, 'auto' or None")
        if self.mtbf_hours is not None and self.mtbf_hours <= 0:
            raise ConfigError(f"mtbf_hours={self.mtbf_hours}: use a positive number of hours")
        if self.min_interval_s <= 0 or self.max_interval_s < self.min_interval_s:
            raise ConfigError(
                f"min_interval_s={self.min_interval_s}, max_interval_s={self.max_interval_s}: need "
                "0 < min_interval_s <= max_interval_s"
            )
        if self.warmup_steps < 1:
            raise ConfigError(f"warmup_steps={self.warmup_steps}: use 1 or more")


@dataclass
class GoodputConfig:
    """The run's goodput ledger and data-wait figures.

    Attributes:
        run_dir: Where the ledger lives (``<run_dir>/goodput/``); it must outlive a restart, and on several nodes
            be on a shared file system. Only the main process writes it.
        span_s: How often the ledger writes what it has summed up as a span; between spans the pending one is
            kept in a side file at each step's end, so a kill loses only the time since the last step ended (it
            then shows as downtime).
        window_steps: Steps per data-wait window (one metrics row and at most one starvation warning each).
        starvation_threshold: Fraction of step time spent waiting for data above which the accelerator starves.
    """

    run_dir: str
    span_s: float = 10.0
    window_steps: int = 50
    starvation_threshold: float = 0.05

    def __post_init__(self) -> None:
        if self.span_s < 0:
            raise ConfigError(f"span_s={self.span_s}: use 0 or more seconds")
        if self.window_steps < 1:
            raise ConfigError(f"window_steps={self.window_steps}: use 1 or more")
        if not 0 < self.starvation_threshold < 1:
            raise ConfigError(
                f"starvation_threshold={self.starvation_threshold}: use a fraction of step time between 0 and 1"
            )


@dataclass(frozen=True)
class Boundary:
    """What a step boundary came to, the same on every rank.

    Attributes:
        step: The optimizer steps done.
        saved: The save the session started here (interval, degraded-fault or emergency save), if any.
        stop: The agreed stop, if any: the step is saved (as far as the grace period allowed) and the adapter
            leaves the training loop, then :meth:`TrainingSession.end` exits with ``stop.exit_code``.
        emergency: What the emergency save of a stop got committed.
    """

    step: int
    saved: SaveHandle | None = None
    stop: Decision | None = None
    emergency: EmergencySave | None = None


class TrainingSession:
    """One training process's step boundary, for any framework.

    Args:
        manager: The checkpoint engine (collective construction already done).
        build_state: Makes the state to save at a step (the adapter's knowledge of its framework).
        is_main: Whether this process writes the goodput ledger and logs (global rank 0).
        boundary: Snapshots the state at a boundary for survivor saves, where ``build_state`` at every step
            would cost too much (default: ``build_state``, its tensors kept as live references).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        build_state: StateBuilder,
        *,
        is_main: bool | None = None,
        boundary: BoundaryBuilder | None = None,
    ):
        self.manager = manager
        self.build_state = build_state
        self.boundary = boundary or self._boundary_from_state
        self.peer_loss: PeerLossConfig | None = None
        self.peer_watch: PeerLossWatch | None = None
        self._peer_loss_lock = threading.Lock()  # the rescue and the training thread may both report it: once
        self._peer_loss_recorded = False
        self.rank = manager.rank
        self.is_main = manager.rank == 0 if is_main is None else is_main
        self.sinks: list[MetricsSink] = []
        self.guard: HealthGuard | None = None
        self.interval: IntervalConfig | None = None
        self.ledger: GoodputLedger | None = None
        self.data: DataWaitMonitor | None = None
        self.telemetry: CheckpointTelemetry | None = None
        self.stopping: Decision | None = None
        self.last_emergency: EmergencySave | None = None
        self.started = False
        self.ended = False
        self._goodput: GoodputConfig | None = None
        self._planner: AdaptiveInterval | None = None
        self._next_auto_step = 0
        self._auto_steps: int | None = None
        self._plan_cost_s = 0.0
        self._plan_saves = 0
        self._step_times: deque[float] = deque(maxlen=50)
        self._last_boundary: Boundary | None = None
        self._last_end_t: float | None = None
        self._batch_t: float | None = None
        self._stall_seen = manager.stats.stall_s
        self._blocking_depth = 0
        self._pending_rng: tuple[dict[str, Any], RngTiming] | None = None
        self._restore_began: float | None = None
        self._prior: GoodputSummary | None = None
        self.last_plan: Any = None
        self._start_step: int | None = None
        self._begun_step: int | None = None
        self._gap_from: tuple[float, float, float] | None = None
        self._health_events: list[FaultEvent] = []
        self._restored_next_step: int | None = None
        self._inside_s = 0.0  # boundary time inside the fetch in progress
        self._fetch_inside_s = 0.0  # boundary time inside the last finished fetch
        self._paused_s = 0.0
        self.stalled_s = 0.0  # every second saves blocked training so far
        self._prior_marks: dict[str, float] = {}

    # ---- components (before start) -----------------------------------------------------------------------------

    def use_health(
        self, config: HealthConfig, *, nvml: Any = None, signals: SignalWatcher | None = None
    ) -> HealthGuard:
        """Watch GPU health, preemption signals and hangs; collective (it creates the check's gloo group).
        ``signals``: the adapter's watcher of stop signals, installed before the session existed."""
        if self.guard is None:
            self.guard = HealthGuard(config, nvml=nvml, listeners=[self._health_event], signals=signals)
        return self.guard

    def _health_event(self, event: FaultEvent) -> None:
        """From the monitor's threads: count it; a hang may be a lost peer, which only a survivor save helps."""
        self._health_events.append(event)
        if event.kind is Kind.HANG and self.peer_watch is not None:
            threading.Thread(target=self._rescue_hang, name="resilience-hang-rescue", daemon=True).start()
        if event.severity is Severity.FATAL and event.kind in GPU_FAULTS:
            # this rank's GPU must not be read again: its share of any save comes from a replica
            self.manager.device_unreadable = event.detail
            rng.DEVICE_UNREADABLE = True

    def _rescue_hang(self) -> None:
        """The training thread is stuck (in a collective with a stopped or vanished rank): save from here.

        A stopped rank's heartbeat goes stale only ``stale_s`` after its last beat, which may be later than the
        hang report: look again until then, and give up as soon as training moves on (a slow step, not a hang).
        """
        watch = self.peer_watch
        assert watch is not None
        stuck_at = self.last_step
        deadline = time.monotonic() + 2 * watch.config.stale_s
        while time.monotonic() < deadline and self.last_step == stuck_at and not self.ended:
            if self._rescued(watch.after_failure(None)):
                return
            time.sleep(watch.config.heartbeat_s)

    def _notice(self, notice: Notice) -> None:
        """From the heartbeat thread: another survivor saves without the lost rank(s), and this rank must join,
        whatever its training thread is doing (under HSDP it may be blocked in a collective with that survivor,
        which would fail only once the survivor gives up)."""
        watch = self.peer_watch
        if watch is None or self.ended:
            return
        threading.Thread(
            target=lambda: self._rescued(watch.after_failure(None, notice)),
            name="resilience-notice-rescue",
            daemon=True,
        ).start()

    def _rescued(self, outcome: SurvivorOutcome | None) -> bool:
        """After a rescue from a side thread: record the survivor save and leave (the process exits; in place, the
        lost ranks are evicted and the training thread unwinds to the restart). False: nobody was lost."""
        if outcome is None:
            return False
        watch = self.peer_watch
        assert watch is not None
        self._record_peer_loss()
        if inplace.active():
            # the training thread stays stuck in its collective until the lost ranks' processes are gone: the
            # launcher ends them, the collective fails, and the training thread unwinds to the restart; one held at
            # the optimizer step's gate is let go with an error
            inplace.evict(outcome.lost)
            watch.release()
            return True
        watch.exit()
        return True

    def on_failure(self, error: BaseException) -> None:
        """The adapter saw ``error`` leave the training loop. If peers are lost, the survivors save and the process
        exits with the restart code; otherwise (and for an exit or Ctrl-C) nothing happens and the error goes on."""
        if (
            self.peer_watch is None
            or not self.started
            or self.ended
            or isinstance(error, (SystemExit, KeyboardInterrupt))
        ):
            return
        if self.peer_watch.after_failure(error) is not None:
            self._record_peer_loss()
            self.peer_watch.exit()

    def _record_peer_loss(self) -> None:
        assert self.peer_watch is not None and self.peer_watch.outcome is not None
        outcome = self.peer_watch.outcome
        what = f"rank(s) {outcome.lost} lost"
        state = "committed" if outcome.committed else f"not committed: {outcome.reason}"
        with self._peer_loss_lock:  # the second thread waits here until the first wrote it, then exits with it
            if self._peer_loss_recorded:
                return
            self._peer_loss_recorded = True
            if self.ledger is None:
                return
            self.ledger.fault(what, outcome.step)
            self.ledger.emergency(outcome.seconds, f"survivor save of step {outcome.step}")
            code = self.peer_watch.config.exit_code
            then = "restarting in place" if inplace.active() else f"stopped, exit code {code}"
            self.ledger.end(f"{then}: {what}; survivor save {state}")

    def use_peer_loss(self, config: PeerLossConfig) -> None:
        """Survivor saves when a rank dies or hangs (effective from :meth:`start`, with a shared local tier)."""
        self.peer_loss = config

    def _boundary_from_state(self, step: int) -> BoundarySnapshot:
        built = self.build_state(step)
        return BoundarySnapshot(step, built.rank_state, lambda: built)

    def use_interval(self, config: IntervalConfig) -> None:
        self.interval = config
        if config.every_n_steps == "auto":
            self._planner = AdaptiveInterval(
                mtbf_s=None if config.mtbf_hours is None else config.mtbf_hours * 3600.0,
                world_size=self.manager.world_size,
                min_s=config.min_interval_s,
                max_s=config.max_interval_s,
            )

    def use_goodput(self, config: GoodputConfig) -> GoodputLedger:
        """Keep the run's ledger (written by the main process) and the data-wait windows of this rank."""
        if self.ledger is None:
            self._goodput = config
            self.ledger = GoodputLedger(
                config.run_dir, self.rank, span_s=config.span_s, process_start=incarnation_start(), write=self.is_main
            )
            self.data = DataWaitMonitor(
                config.window_steps, config.starvation_threshold, rank=self.rank, on_window=self._window
            )
            if self.is_main:
                self.telemetry = CheckpointTelemetry(ledger=self.ledger, sample_gpu=_cuda_in_use())
                self.manager.add_listener(self.telemetry)
        return self.ledger

    def add_sink(self, sink: MetricsSink) -> None:
        """Metrics go to every sink, on the training thread, at the boundary they belong to."""
        self.sinks.append(sink)

    # ---- resume ----------------------------------------------------------------------------------------------

    def restore(
        self,
        target: Any = None,
        *,
        step: int | None = None,
        leave_out: Collection[str] = (),
        per_rank: str = "each rank's own state",
    ) -> Restored | None:
        """Load ``step`` (None: the newest that verifies) on every rank (:meth:`CheckpointManager.load`).

        The per-rank part of a checkpoint saved by another number of processes fits none of this run's ranks:
        it comes back as None, and the main process says that ``per_rank`` starts afresh. The time from here to
        :meth:`restored` (the adapter putting the state in place) is the restore's time in the ledger.
        """
        self._restore_began = time.perf_counter()
        restored = self.manager.load(target, step=step, leave_out=leave_out)
        if restored is None:
            return None
        if restored.manifest.world_size == self.manager.world_size:
            lost = (restored.manifest.extra.get("survivor_save") or {}).get("lost", [])
            if restored.rank_state is None and self.manager.rank in lost:
                # a rank lost before its heartbeat wrote its state of this boundary (docs/HEALTH.md)
                log.warning(
                    "rank %d: step %d was saved by the survivors after this rank was lost, without its own "
                    "state of that step: %s starts afresh, so this rank's part of the run will not repeat exactly",
                    self.manager.rank,
                    restored.step,
                    per_rank,
                )
            return restored
        if self.is_main:
            log.warning(
                "step %d (%s) was saved by %d processes and this run has %d: the shared state is restored "
                "(resharded), but %s starts afresh",
                restored.step,
                restored.path,
                restored.manifest.world_size,
                self.manager.world_size,
                per_rank,
            )
        return replace(restored, rank_state=None)

    def restored(self, restored: Restored | None, *, rng_at: RngTiming = "now", position: str = "") -> None:
        """A resume happened (or found nothing: ``restored`` None), and its state is in place.

        The main process says what was restored (step, tier, path, what was verified, and ``position``, the
        adapter's words for where training continues). The rank state's ``"rng"`` streams (:func:`capture_rng`),
        if any, are applied ``"now"``, when training starts, or when the next batch is in hand (a mid-epoch save
        was taken with the loader's iterator already made, which draws from the RNG).
        """
        began, self._restore_began = self._restore_began, None
        seconds = time.perf_counter() - began if began is not None else 0.0
        if self.ledger is not None:
            parts = restored.timings if restored is not None else {}
            self.ledger.restored(restored.step if restored is not None else None, seconds, parts)
        self._pending_rng = None
        if restored is None:
            return
        if self.is_main:
            sizes = self.manager.config.verify == "size"
            checks = "sizes and small files' checksums" if sizes else "every file's checksum"
            where = f"Restored step {restored.step} from the {restored.tier} tier ({restored.path}) in {seconds:.1f} s"
            log.info("%s, verified: %s%s", where, checks, f"; {position}" if position else "")
        saved_rng = restored.rank_state.get("rng") if isinstance(restored.rank_state, dict) else None
        if saved_rng is not None:
            if rng_at == "now":
                restore_rng(saved_rng)
            else:
                self._pending_rng = (saved_rng, rng_at)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Training is about to begin at ``step``; collective. Claims the root, starts the monitors; once (a later
        call does nothing, so an adapter may call it wherever training may begin)."""
        if self.started:
            return
        if self.guard is None and os.environ.get(INJECT_ENV_VAR, "").strip():
            raise ConfigError(
                f"{INJECT_ENV_VAR}={os.environ[INJECT_ENV_VAR]!r} plans a fault drill, but this run does not watch "
                "health, so nothing would be injected: add HealthGuardCallback() to the Trainer (Lightning), or set "
                "ACCELERATE_RESILIENCE_HEALTH=1 (Accelerate), or unset the variable"
            )
        self.manager.claim(resumed_from=step if self.manager.saved(step) is not None else None)
        self.started = True
        self._start_step = step
        config = self.peer_loss
        if config is not None and config.enabled and self.manager.world_size > 1:
            if self.manager.local_shared:
                self.peer_watch = PeerLossWatch(self.manager, config, self.boundary, on_notice=self._notice)
            elif self.is_main:
                log.warning(
                    "survivor saves need a local tier every rank sees (local_shared): they are off for this run"
                )
        if self.guard is not None:
            self.guard.start()  # signal handlers: the main thread
        if self._pending_rng is not None and self._pending_rng[1] == "start":
            restore_rng(self._pending_rng[0])
            self._pending_rng = None
        if self.ledger is not None:
            self.ledger.startup_done()
            self._read_prior()
        self._next_auto_step = self._restored_next_step or step + (self.interval.warmup_steps if self.interval else 0)
        self._last_end_t = time.perf_counter()
        self._stall_seen = self.manager.stats.stall_s

    @property
    def last_step(self) -> int | None:
        """The step of the last boundary (or the one training started at); None before :meth:`start`."""
        return self._last_boundary.step if self._last_boundary is not None else self._start_step

    def step_begin(
        self, step: int | None = None, *, wait_s: float | None = None, samples: int = 0, infer_wait: bool = True
    ) -> None:
        """A step starts, its batch in hand; once per ``step``.

        ``wait_s``: how long the loop blocked for this batch. None with ``infer_wait`` infers it from the gap
        since the last step ended, less what saves blocked and validation took (for frameworks with no hook
        around the fetch); without ``infer_wait`` nothing is recorded here (the loader is :meth:`timed`, or not
        measured). The wait is data wait in the ledger and a sample of the data window; a saved RNG that belongs
        here is re-applied.
        """
        if step is not None:
            if step == self._begun_step:
                return
            self._begun_step = step
        now = time.perf_counter()
        if wait_s is None and infer_wait and self._gap_from is not None:
            t0, stalled, paused = self._gap_from
            wait_s = max(0.0, now - t0 - (self.stalled_s - stalled) - (self._paused_s - paused))
        if wait_s is not None:
            if self.ledger is not None:
                self.ledger.data_wait(wait_s)
            if self.data is not None and self._batch_t is not None:
                self.data.record(wait_s, now - self._batch_t, samples)
        self._batch_t = now
        if self._pending_rng is not None and self._pending_rng[1] == "next_batch":
            restore_rng(self._pending_rng[0])
            self._pending_rng = None
        if self.ledger is not None:
            self.ledger.step_begin()

    def timed(self, loader: Iterable[T], settings: Any = None) -> TimedIterator[T]:
        """``loader``, timing each ``next()``: data wait in the ledger, and data-wait windows to the sinks.

        For adapters whose step boundary runs inside the loader's ``next()`` (Accelerate's): the boundary's
        own time there (saves, the health check) is not data wait. ``settings``: the DataLoader whose settings
        a starvation warning names (workers, pinning, prefetching).
        """
        if self.data is None:
            raise ConfigError("timing the data loader needs the goodput ledger: turn goodput on")
        if settings is not None:
            self.data.watch(settings)
        return TimedIterator(loader, _LessBoundary(self), on_wait=self._fetched)

    def _fetched(self, wait_s: float) -> None:
        """One ``next()`` returned after ``wait_s``, of which the boundary took ``_inside_s``."""
        self._fetch_inside_s, self._inside_s = self._inside_s, 0.0
        if self.ledger is not None:
            self.ledger.data_wait(max(0.0, wait_s - self._fetch_inside_s))

    def step_end(self, step: int) -> Boundary:
        """An optimizer step completed; collective. Runs once per step, whichever hook calls it first."""
        if not self.started:
            raise RuntimeError("TrainingSession.step_end() before start()")
        if self._last_boundary is not None and self._last_boundary.step == step:
            return self._last_boundary
        now = time.perf_counter()
        try:
            return self._step_end(step, now)
        finally:
            self._inside_s += time.perf_counter() - now

    def _step_end(self, step: int, now: float) -> Boundary:
        if self.peer_watch is not None:  # first: a collective of this boundary may be what fails
            self.peer_watch.at_boundary(step)
        if self._last_end_t is not None:
            self._step_times.append(now - self._last_end_t)
        self._account_stall()
        if self.ledger is not None:
            self.ledger.step_end(step)
        boundary = self._decide(step)
        self._flush_telemetry()
        self._flush_health_events()
        self._last_end_t = time.perf_counter()
        self._gap_from = (self._last_end_t, self.stalled_s, self._paused_s)
        self._last_boundary = boundary
        return boundary

    def _decide(self, step: int) -> Boundary:
        if self.guard is not None:
            decision = self.guard.on_step(step)
            if decision.stop:
                return self._emergency(step, decision)
            if decision.save:
                return Boundary(step, saved=self.save(step, reason="degraded"))
        if self.interval is None or self.interval.every_n_steps is None or step <= 0:
            return Boundary(step)
        if self._planner is None:
            due = step % int(self.interval.every_n_steps) == 0
            return Boundary(step, saved=self.save(step, reason="interval") if due else None)
        if step < self._next_auto_step:
            return Boundary(step)
        handle = self.save(step, reason="interval")
        self._replan(step)
        return Boundary(step, saved=handle)

    def _emergency(self, step: int, decision: Decision) -> Boundary:
        assert self.guard is not None
        start = time.perf_counter()
        self._blocking_depth += 1  # the emergency's time is its own bucket, not checkpoint stall
        try:
            result = self.guard.emergency_save(
                self.manager, step, save=lambda: self._save_now(step, abstain=decision.sick_ranks)
            )
        finally:
            self._blocking_depth -= 1
            self._stall_seen = self.manager.stats.stall_s
        self.stopping = decision
        self.last_emergency = result
        if self.ledger is not None:
            self.ledger.fault(decision.reason, decision.step)
            self.ledger.emergency(time.perf_counter() - start, f"emergency save of step {step}")
        metrics = {"health/emergency_local_committed": float(result.local_committed)}
        if result.fault_to_local_s is not None:
            metrics["health/fault_to_commit_s"] = result.fault_to_local_s
        self._emit(metrics)
        return Boundary(step, saved=self.manager.saved(step), stop=decision, emergency=result)

    # ---- saves -----------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: SaveState | None = None,
        *,
        reason: str = "requested",
        when_busy: WhenBusy | None = None,
        abstain: tuple[int, ...] = (),
    ) -> SaveHandle | None:
        """Save ``step`` (a second save of a step this run saved already is the first one's handle); collective.

        ``state`` defaults to the adapter's :data:`StateBuilder`. The time it blocks is checkpoint stall.
        """
        existing = self.manager.saved(step)
        if existing is not None:
            return existing
        with self.blocking():
            built = state if state is not None else self.build_state(step)
            handle = self.manager.save(
                step,
                built.state,
                built.rank_state,
                extra=built.extra,
                when_busy=when_busy,
                abstain=abstain,
                replicated=built.replicated,
                record_crcs=built.record_crcs,
            )
        if handle is not None:
            self._plan_saves += 1
            log.debug("rank %d: %s save of step %d started", self.rank, reason, step)
        return handle

    def _save_now(self, step: int, abstain: tuple[int, ...] = ()) -> SaveHandle | None:
        return self.save(step, reason="emergency", when_busy="wait", abstain=abstain)

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Time inside counts as checkpoint stall (nested uses count once): wrap any save made for training."""
        self._blocking_depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._blocking_depth -= 1
            if self._blocking_depth == 0:
                self._stall_seen = self.manager.stats.stall_s  # the manager's share is in this span
                self._stall(time.perf_counter() - start)

    def wait(self, *, durable: bool = False) -> bool:
        """Block until the last save is committed (and uploaded, with ``durable``); raise its error."""
        with self.blocking():
            return self.manager.wait(durable=durable)

    def _account_stall(self) -> None:
        """Staging waits before optimizer steps (outside any save) since the last boundary."""
        if self._blocking_depth:
            return
        total = self.manager.stats.stall_s
        waited, self._stall_seen = total - self._stall_seen, total
        if waited > 0:
            self._stall(waited)

    def _stall(self, seconds: float) -> None:
        self.stalled_s += seconds
        if self.ledger is not None and self.started:
            self.ledger.checkpoint_stall(seconds, self._last_boundary.step if self._last_boundary else 0)
        self._plan_cost_s += seconds

    def _replan(self, step: int) -> None:
        assert self._planner is not None and self.interval is not None
        planner, cost, saves = self._planner, self._plan_cost_s, self._plan_saves
        step_s = statistics.median(self._step_times) if self._step_times else None

        def plan() -> Any:
            if saves:
                planner.observe_cost(cost / saves)
            if self._prior is not None:  # uptime: the finished incarnations', and this one's so far
                finished = sum(inc.uptime_s for inc in self._prior.incarnations[:-1])
                planner.observe_run(finished + time.time() - self._prior.incarnations[-1].start, self._prior.failures)
            return planner.plan(step_s=step_s)

        chosen = self.manager.groups.control.decide(plan)  # rank 0 plans; every rank saves at the same steps
        self._plan_cost_s, self._plan_saves = 0.0, 0
        self._auto_steps = chosen.interval_steps or self.interval.warmup_steps
        self._next_auto_step = step + self._auto_steps
        self.last_plan = chosen
        self._emit(chosen.metrics(self._auto_steps))
        if self.is_main:
            log.info("every_n_steps='auto': the next save at step %d; %s", self._next_auto_step, chosen.describe())

    # ---- metrics ---------------------------------------------------------------------------------------------

    def _window(self, window: DataWindow) -> None:
        self._emit({**window.metrics(), **self.goodput_metrics()})

    def goodput_metrics(self) -> dict[str, float]:
        """This incarnation's buckets and the whole run's goodput so far (earlier incarnations included)."""
        if self.ledger is None:
            return {}
        live = self.ledger.metrics()
        if self._prior is None:
            return live
        prior = self._prior
        spent = {b: live.get(f"goodput/{b}_s", 0.0) - self._prior_marks.get(b, 0.0) for b in prior.buckets}
        productive = prior.buckets["productive"] + spent.get("productive", 0.0)
        wall = prior.wall_s + sum(v for v in spent.values() if v > 0)
        return {
            **live,
            "goodput/run_pct": 100.0 * productive / wall if wall > 0 else 0.0,
            "goodput/run_lost_s": prior.buckets["lost"],
            "goodput/run_downtime_s": prior.buckets["downtime"],
            "goodput/run_restarts": float(len(prior.incarnations) - 1),
        }

    def _read_prior(self) -> None:
        """The run as the ledger tells it at this incarnation's start (lost work of the restart included)."""
        assert self.ledger is not None and self._goodput is not None
        if not self.is_main or not any(ledger_dir(self._goodput.run_dir).glob("incarnation-*.jsonl")):
            return
        self.ledger.flush()
        try:
            self._prior = summarize(self._goodput.run_dir)
        except Exception as exc:  # accounting must never stop training
            log.warning("goodput: could not read the run's ledger: %s", exc)
            return
        live = self.ledger.metrics()
        self._prior_marks = {b: live.get(f"goodput/{b}_s", 0.0) for b in self._prior.buckets}

    def _flush_health_events(self) -> None:
        """How many faults of each severity this rank saw since the last boundary."""
        events, self._health_events[:] = list(self._health_events), []
        counts: dict[str, float] = {}
        for event in events:
            key = f"health/{event.severity.name.lower()}_events"
            counts[key] = counts.get(key, 0.0) + 1
        self._emit(counts)

    def interval_state(self) -> dict[str, Any]:
        """What the ``"auto"`` interval must keep across a restart (so it does not warm up again)."""
        return {"next_step": self._next_auto_step, "interval_steps": self._auto_steps}

    def load_interval_state(self, state: dict[str, Any]) -> None:
        if self._planner is not None and state.get("interval_steps"):
            self._auto_steps = int(state["interval_steps"])
            self._restored_next_step = int(state["next_step"])

    def _flush_telemetry(self) -> None:
        if self.telemetry is not None:
            for metrics in self.telemetry.drain():
                self._emit(metrics)

    def _emit(self, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        for sink in self.sinks:
            try:
                sink(metrics)
            except Exception:  # a logger's failure must not stop training
                log.exception("metrics sink %r failed", sink)

    # ---- end ---------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work between steps that is neither a step nor data (validation): no hang, and no data wait."""
        start = time.perf_counter()
        with self.guard.paused() if self.guard is not None else contextlib.nullcontext():
            try:
                yield
            finally:
                self._paused_s += time.perf_counter() - start

    def end(self, failure: BaseException | str | None = None, *, close_manager: bool = True) -> None:
        """Wait for the last saves and uploads, close the ledger (completed, stopped or failed) and the monitors.

        Idempotent. Raises the first background failure of the saves, after the ledger is closed. With
        ``close_manager=False`` the manager stays open (drained, at rest: no helper process or thread until its
        next save) for saves after training, e.g. a final ``trainer.save_checkpoint``.
        """
        if self.ended:
            return
        self.ended = True
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            if self._peer_loss_recorded and inplace.requested():
                self.manager.abandon()  # the process goes on without its lost peers: nothing in flight can finish
            elif failure is not None and not isinstance(failure, str):
                # training failed: the last saves get a bounded wait (a peer may be gone), and so does the exit
                self.manager.exit_timeout_s = FAILED_EXIT_WAIT_S
                if not self.manager.drain(FAILED_DRAIN_S):
                    log.warning("the last saves did not finish within %.0f s of the failure", FAILED_DRAIN_S)
            elif close_manager:
                self.manager.close()
            else:
                self.manager.rest()
        except BaseException as exc:
            error = exc
        closing_s = time.perf_counter() - start
        self._flush_telemetry()
        if self.ledger is not None:
            if self.stopping is not None:
                self.ledger.emergency(closing_s, "the stop's last writes and uploads")
                reason = f"stopped, exit code {self.stopping.exit_code}: {self.stopping.reason}"
            else:
                self._account_stall()
                self._stall(closing_s)
                if failure is None and error is None:
                    reason = COMPLETED
                elif isinstance(failure, str):
                    reason = failure
                else:
                    cause = failure if failure is not None else error
                    reason = f"{type(cause).__name__}: {cause}"
            self.ledger.end(reason[:300])
        if self.telemetry is not None:
            self.manager.remove_listener(self.telemetry)
            self.telemetry.close()
        if self.peer_watch is not None:
            self.peer_watch.close()
        if self.guard is not None and self.stopping is None:
            self.guard.close()
        if error is not None:
            raise error

    def exit(self) -> NoReturn:
        """After an agreed stop: leave the process with the stop's code, for the launcher to restart it."""
        if self.stopping is None or self.guard is None:
            raise RuntimeError("TrainingSession.exit() without an agreed stop")
        try:
            self.end()
        except Exception as exc:  # a failed last save is logged (and in the ledger); the stop's code still counts
            log.error("rank %d: the last saves before the stop failed: %s", self.rank, exc)
        self.guard.stop()


class _LessBoundary:
    """The data-wait monitor as :class:`TimedIterator` sees it: each wait less the boundary's time inside it."""

    def __init__(self, session: TrainingSession):
        self.session = session

    def record(self, wait_s: float, step_s: float, samples: int = 0) -> None:
        session = self.session
        session._inside_s = 0.0  # a fetch begins: boundary time from outside a timed fetch is not this one's
        assert session.data is not None
        session.data.record(max(0.0, wait_s - session._fetch_inside_s), step_s, samples)


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()
