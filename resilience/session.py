"""The training session: everything the pack does at a step boundary, once, for every framework.

A framework adapter keeps three parts only: it builds the state to save (:data:`StateBuilder`), it wires the
framework's hooks to the session's calls, and it gives the session a metrics sink (its loggers or trackers).
The session owns the rest, composed of parts, each in the subpackage of what it is about:

* :class:`~resilience.goodput.interval.SessionInterval`: saves on a fixed interval or on the Young/Daly one
  (``"auto"``), planned on rank 0 and agreed by all;
* :class:`~resilience.health.session_health.SessionHealth`: at each boundary the ranks agree on faults and
  preemption signals; a stop is an emergency save within the grace period, returned to the adapter as a
  :class:`Boundary` with the exit code (never raised from inside a framework's data loader);
* :class:`~resilience.recovery.session_peers.SessionPeerLoss`: when a peer dies or hangs, the survivors save;
* :class:`~resilience.health.stragglers.SessionStragglers`: every few dozen steps the ranks compare how their
  steps split (data wait, compute, waiting in collectives) and name a rank persistently slower than the others;
* :class:`~resilience.goodput.accounting.SessionGoodput`: the time saves blocked training (their staging waits
  before an optimizer step included), data waits, restores and emergencies go to the ledger; per-save telemetry
  and data-wait windows to the sinks;
* :class:`~resilience.checkpoint.resume.SessionResume`: a resume, and the saved RNG streams re-applied where
  the saved run stood.

Each part owns its state; what it needs from the others it gets from the session as a callback. The session
itself keeps the order of things at a step boundary and makes the saves. Call order on every rank::

    restored = session.restore(target)     # a resume (optional); then session.restored(restored)
    session.start(step)                    # training begins (collective: claims the checkpoint root)
    loop: session.step_begin(); ...; boundary = session.step_end(step)  # collective
          if boundary.stop: leave the loop
    session.end(reason)                    # waits for the last saves; exits with the stop's code if stopped
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

from resilience.checkpoint.loader import Restored
from resilience.checkpoint.manager import CheckpointManager
from resilience.checkpoint.resume import RngTiming, SessionResume
from resilience.checkpoint.save_handle import SaveHandle
from resilience.config import WhenBusy
from resilience.errors import CheckpointError
from resilience.goodput import (
    DataWaitMonitor,
    GoodputConfig,
    GoodputLedger,
    IntervalConfig,
    IntervalPlan,
    TimedIterator,
)
from resilience.goodput.accounting import MetricsSink, SessionGoodput, Sinks
from resilience.goodput.interval import SessionInterval
from resilience.goodput.ledger import COMPLETED
from resilience.health import Decision, EmergencySave, HealthConfig, HealthGuard, SignalWatcher
from resilience.health.session_health import SessionHealth
from resilience.health.stragglers import SessionStragglers, StragglerConfig
from resilience.recovery import inplace
from resilience.recovery.peer_loss import BoundaryBuilder, PeerLossConfig, PeerLossWatch, boundary_from_state
from resilience.recovery.session_peers import SessionPeerLoss

log = logging.getLogger(__name__)
FAILED_DRAIN_S = 30.0  # after a failure, how long the last saves may still take before the session ends
FAILED_EXIT_WAIT_S = 5.0  # ... and how long the process exit then waits for them
T = TypeVar("T")


@dataclass(frozen=True)
class SaveState:
    """What the adapter hands the engine for one save: the shared tree, this rank's tree, manifest extras, and
    which top-level keys of the shared tree every rank holds alike (None: all; see ``CheckpointManager.save``)."""

    state: Any
    rank_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    replicated: tuple[str, ...] | None = None


StateBuilder = Callable[[int], SaveState]


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
        self.rank = manager.rank
        self.is_main = manager.rank == 0 if is_main is None else is_main
        self.stopping: Decision | None = None
        self.last_emergency: EmergencySave | None = None
        self.started = False
        self.ended = False
        self._start_step: int | None = None
        self._begun_step: int | None = None
        self._last_boundary: Boundary | None = None
        self._last_end_t: float | None = None
        self.sinks = Sinks()
        self.interval = SessionInterval(manager, emit=self.sinks.emit, is_main=self.is_main)
        self.goodput = SessionGoodput(
            manager, is_main=self.is_main, emit=self.sinks.emit, on_stall=self.interval.stalled
        )
        self.peers = SessionPeerLoss(
            manager,
            boundary or boundary_from_state(build_state),
            record=self.goodput.survivor_save,
            last_step=lambda: self.last_step,
            over=lambda: self.ended,
            is_main=self.is_main,
        )
        self.health = SessionHealth(
            manager, emit=self.sinks.emit, on_hang=self.peers.hang_seen, rescuing=self.peers.rescuing
        )
        self.resume = SessionResume(manager, is_main=self.is_main, on_restored=self.goodput.restored)
        self.stragglers = SessionStragglers(
            manager, emit=self.sinks.emit, record=self.goodput.note, data_wait=lambda: self.goodput.data_wait_s
        )

    # ---- parts (before start) ----------------------------------------------------------------------------------

    def use_health(
        self, config: HealthConfig, *, nvml: Any = None, signals: SignalWatcher | None = None
    ) -> HealthGuard:
        """Watch GPU health, preemption signals and hangs; collective (it creates the check's gloo group).
        ``signals``: the adapter's watcher of stop signals, installed before the session existed. Stragglers are
        watched with it (:class:`StragglerConfig` from its variables, unless :meth:`use_stragglers` said otherwise).
        """
        if self.stragglers.config is None:
            self.stragglers.use(StragglerConfig())
        return self.health.use(config, nvml=nvml, signals=signals)

    def use_stragglers(self, config: StragglerConfig) -> None:
        """Compare the ranks' step times every ``config.window`` steps (see :mod:`resilience.health.stragglers`)."""
        self.stragglers.use(config)

    def use_peer_loss(self, config: PeerLossConfig) -> None:
        """Survivor saves when a rank dies or hangs (effective from :meth:`start`, with a shared local tier)."""
        self.peers.use(config)

    def use_interval(self, config: IntervalConfig) -> None:
        self.interval.use(config)

    def use_goodput(self, config: GoodputConfig) -> GoodputLedger:
        """Keep the run's ledger (written by the main process) and the data-wait windows of this rank."""
        return self.goodput.use(config)

    def add_sink(self, sink: MetricsSink) -> None:
        """Metrics go to every sink, on the training thread, at the boundary they belong to."""
        self.sinks.add(sink)

    @property
    def ledger(self) -> GoodputLedger | None:
        return self.goodput.ledger

    @property
    def data(self) -> DataWaitMonitor | None:
        return self.goodput.data

    @property
    def last_plan(self) -> IntervalPlan | None:
        """With ``every_n_steps="auto"``: the last plan (the same on every rank)."""
        return self.interval.last_plan

    @property
    def peer_watch(self) -> PeerLossWatch | None:
        return self.peers.watch

    @peer_watch.setter
    def peer_watch(self, watch: PeerLossWatch | None) -> None:
        """A watch made elsewhere (a test's, with its liveness faked)."""
        self.peers.watch = watch

    def interval_state(self) -> dict[str, Any]:
        """What the ``"auto"`` interval must keep across a restart (so it does not warm up again)."""
        return self.interval.state()

    def load_interval_state(self, state: dict[str, Any]) -> None:
        self.interval.load_state(state)

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
        return self.resume.restore(target, step=step, leave_out=leave_out, per_rank=per_rank)

    def restored(self, restored: Restored | None, *, rng_at: RngTiming = "now", position: str = "") -> None:
        """A resume happened (or found nothing: ``restored`` None), and its state is in place.

        The main process says what was restored (step, tier, path, what was verified, and ``position``, the
        adapter's words for where training continues). The rank state's ``"rng"`` streams (:func:`capture_rng`),
        if any, are applied ``"now"``, when training starts, or when the next batch is in hand (a mid-epoch save
        was taken with the loader's iterator already made, which draws from the RNG).
        """
        self.resume.restored(restored, rng_at=rng_at, position=position)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Training is about to begin at ``step``; collective. Claims the root, starts the monitors; once (a later
        call does nothing, so an adapter may call it wherever training may begin)."""
        if self.started:
            return
        self.health.check_drill()
        self.manager.claim(resumed_from=step if self.manager.saved(step) is not None else None)
        self.started = True
        self._start_step = step
        self.peers.start()
        self.health.start()
        self.resume.rng_due("start")
        self.goodput.start()
        self.interval.start(step)
        self.stragglers.start(step, self.health.guard.planned if self.health.guard is not None else ())
        self._last_end_t = time.perf_counter()

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
        self.goodput.batch_in_hand(wait_s, samples, infer_wait=infer_wait)
        self.resume.rng_due("next_batch")
        self.goodput.step_begins()

    def timed(self, loader: Iterable[T], settings: Any = None) -> TimedIterator[T]:
        """``loader``, timing each ``next()``: data wait in the ledger, and data-wait windows to the sinks.

        For adapters whose step boundary runs inside the loader's ``next()`` (Accelerate's): the boundary's
        own time there (saves, the health check) is not data wait. ``settings``: the DataLoader whose settings
        a starvation warning names (workers, pinning, prefetching).
        """
        return self.goodput.timed(loader, settings)

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
            self.goodput.boundary_took(time.perf_counter() - now)

    def _step_end(self, step: int, now: float) -> Boundary:
        self.peers.at_boundary(step)  # first: a collective of this boundary may be what fails
        if self._last_end_t is not None:
            self.interval.step_took(now - self._last_end_t)
        self.goodput.step_ended(step)
        boundary = self._decide(step)
        self.goodput.flush_telemetry()
        self.health.flush_events()
        self.stragglers.at_boundary(step, now)  # last: a drill's sleep is waited for in the next step's collectives
        self._last_end_t = time.perf_counter()
        self.goodput.boundary_done(step, self._last_end_t)
        self._last_boundary = boundary
        inplace.running()  # once per generation: this node's launcher may start its warm spare now
        return boundary

    def _decide(self, step: int) -> Boundary:
        decision = self.health.on_step(step)
        if decision is not None and decision.stop:
            return self._emergency(step, decision)
        if decision is not None and decision.save:
            return Boundary(step, saved=self.save(step, reason="degraded"))
        if not self.interval.due(step):
            return Boundary(step)
        handle = self.save(step, reason="interval")
        self.interval.replan(step, self.goodput.run_so_far)
        return Boundary(step, saved=handle)

    def _emergency(self, step: int, decision: Decision) -> Boundary:
        start = time.perf_counter()
        with self.goodput.apart():  # the emergency's time is its own bucket, not checkpoint stall
            result = self.health.emergency_save(
                step, save=lambda: self.save(step, reason="emergency", when_busy="wait", abstain=decision.sick_ranks)
            )
        self.stopping = decision
        self.last_emergency = result
        seconds = time.perf_counter() - start
        self.goodput.emergency_save(step, seconds, fault=decision.reason, fault_step=decision.step)
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
            )
        if handle is not None:
            self.interval.save_started()
            log.debug("rank %d: %s save of step %d started", self.rank, reason, step)
        return handle

    def blocking(self) -> AbstractContextManager[None]:
        """Time inside counts as checkpoint stall (nested uses count once): wrap any save made for training."""
        return self.goodput.blocking()

    def wait(self, *, durable: bool = False) -> bool:
        """Block until the last save is committed (and uploaded, with ``durable``); raise its error."""
        with self.blocking():
            return self.manager.wait(durable=durable)

    # ---- end ---------------------------------------------------------------------------------------------------

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Work between steps that is neither a step nor data (validation): no hang, and no data wait."""
        with self.goodput.paused(), self.health.paused():
            yield

    def on_failure(self, error: BaseException) -> None:
        """The adapter saw ``error`` leave the training loop. If peers are lost, the survivors save and the process
        exits with the restart code; otherwise (and for an exit or Ctrl-C) nothing happens and the error goes on."""
        if self.started and not self.ended:
            self.peers.on_failure(error)

    def end(self, failure: BaseException | str | None = None, *, close_manager: bool = True) -> None:
        """Wait for the last saves and uploads, close the ledger (completed, stopped or failed) and the monitors.

        Idempotent. Raises the first background failure of the saves, after the ledger is closed; when training
        failed (``failure``), logs it instead: ``failure`` is the error that goes on. With
        ``close_manager=False`` the manager stays open (drained, at rest: no helper process or thread until its
        next save) for saves after training, e.g. a final ``trainer.save_checkpoint``.
        """
        if self.ended:
            return
        self.ended = True
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            self._settle_saves(failure, close_manager)
        except BaseException as exc:
            error = exc
        closing_s = time.perf_counter() - start
        self.goodput.end(closing_s, _end_reason(self.stopping, failure, error), stopped=self.stopping is not None)
        self.peers.close()
        self.stragglers.close()
        if self.stopping is None:
            self.health.close()
        if error is not None:
            raise error

    def _settle_saves(self, failure: BaseException | str | None, close_manager: bool) -> None:
        if self.peers.recorded and inplace.requested():
            self.manager.abandon()  # the process goes on without its lost peers: nothing in flight can finish
        elif failure is not None and not isinstance(failure, str):
            # training failed: the last saves get a bounded wait (a peer may be gone), and so does the exit
            self.manager.exit_timeout_s = FAILED_EXIT_WAIT_S
            try:
                drained = self.manager.drain(FAILED_DRAIN_S)
            except CheckpointError as exc:
                # often the same fault (a lost peer broke the save's collectives too): said, and the training's
                # error goes on as the one that ended the process, not this one raised over it
                log.error("rank %d: a save in flight failed as training did: %s", self.rank, exc)
                return
            if not drained:
                log.warning("the last saves did not finish within %.0f s of the failure", FAILED_DRAIN_S)
        elif close_manager:
            self.manager.close(self._stop_work_left())
        else:
            self.manager.rest()

    def _stop_work_left(self) -> float | None:
        """After an agreed stop: the seconds its grace leaves for the last uploads (None: no bound). What is not
        uploaded by then stays committed locally, for the next start to upload."""
        guard = self.health.guard
        if self.stopping is None or guard is None or guard.deadline is None:
            return None
        return guard.deadline.work_left()

    def exit(self) -> NoReturn:
        """After an agreed stop: leave the process with the stop's code, for the launcher to restart it."""
        if self.stopping is None or self.health.guard is None:
            raise RuntimeError("TrainingSession.exit() without an agreed stop")
        try:
            self.end()
        except Exception as exc:  # a failed last save is logged (and in the ledger); the stop's code still counts
            log.error("rank %d: the last saves before the stop failed: %s", self.rank, exc)
        self.health.stop()


def _end_reason(stopping: Decision | None, failure: BaseException | str | None, error: BaseException | None) -> str:
    """How the incarnation ended, for the ledger."""
    if stopping is not None:
        return f"stopped, exit code {stopping.exit_code}: {stopping.reason}"
    if failure is None and error is None:
        return COMPLETED
    if isinstance(failure, str):
        return failure
    cause = failure if failure is not None else error
    return f"{type(cause).__name__}: {cause}"
