"""The training session's goodput: its ledger, data-wait windows and per-save telemetry, and what saves blocked.

No framework tells the ledger what it needs, so the session measures it at its step boundary: the time saves
blocked training (their staging waits before an optimizer step included), the time the loop waited for data
(timed around the loader's ``next()``, or inferred from the gap between steps), and the run so far as the
ledger told it when this incarnation started (earlier incarnations' goodput; the uptime and failures the
``"auto"`` interval plans with). What saves blocked is counted with or without a ledger: the interval's
measure of a save's cost.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from resilience.errors import ConfigError
from resilience.goodput.data import DataWaitMonitor, DataWindow, TimedIterator
from resilience.goodput.ledger import GoodputLedger, incarnation_start, ledger_dir
from resilience.goodput.summary import GoodputSummary, summarize
from resilience.goodput.telemetry import CheckpointTelemetry

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager
    from resilience.recovery.survivors import SurvivorOutcome

log = logging.getLogger(__name__)
T = TypeVar("T")
MetricsSink = Callable[[dict[str, float]], None]


class Sinks:
    """Where the session's metrics go: the adapter's loggers or trackers, on the training thread."""

    def __init__(self) -> None:
        self._sinks: list[MetricsSink] = []

    def add(self, sink: MetricsSink) -> None:
        self._sinks.append(sink)

    def emit(self, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        for sink in self._sinks:
            try:
                sink(metrics)
            except Exception:  # a logger's failure must not stop training
                log.exception("metrics sink %r failed", sink)


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


class SessionGoodput:
    """The session's goodput accounting; the ledger and data windows only after :meth:`use`.

    Args:
        manager: Its stall counter (staging waits before an optimizer step) and, on the main process, its save
            events for the telemetry.
        is_main: Whether this process writes the ledger and collects per-save telemetry.
        emit: Where metrics go.
        on_stall: Told every second saves block training.
    """

    def __init__(
        self, manager: CheckpointManager, *, is_main: bool, emit: MetricsSink, on_stall: Callable[[float], None]
    ) -> None:
        self._manager = manager
        self._is_main = is_main
        self._emit = emit
        self._on_stall = on_stall
        self.config: GoodputConfig | None = None
        self.ledger: GoodputLedger | None = None
        self.data: DataWaitMonitor | None = None
        self.telemetry: CheckpointTelemetry | None = None
        self.stalled_s = 0.0  # every second saves blocked training so far
        self.data_wait_s = 0.0  # every second this rank waited for data so far
        self._stall_seen = manager.stats.stall_s
        self._blocking_depth = 0
        self._started = False
        self._boundary_step = 0  # the last boundary's, the step a stall is booked at
        self._prior: GoodputSummary | None = None
        self._prior_marks: dict[str, float] = {}
        self._batch_t: float | None = None
        self._gap_from: tuple[float, float, float] | None = None  # the last boundary's end, stalled_s, paused_s
        self._inside_s = 0.0  # boundary time inside the fetch in progress
        self._fetch_inside_s = 0.0  # boundary time inside the last finished fetch
        self._paused_s = 0.0

    def use(self, config: GoodputConfig) -> GoodputLedger:
        """Keep the run's ledger (written by the main process) and the data-wait windows of this rank."""
        if self.ledger is None:
            self.config = config
            rank = self._manager.rank
            self.ledger = GoodputLedger(
                config.run_dir, rank, span_s=config.span_s, process_start=incarnation_start(), write=self._is_main
            )
            self.data = DataWaitMonitor(
                config.window_steps, config.starvation_threshold, rank=rank, on_window=self._window
            )
            if self._is_main:
                self.telemetry = CheckpointTelemetry(ledger=self.ledger, sample_gpu=_cuda_in_use())
                self._manager.add_listener(self.telemetry)
        return self.ledger

    # ---- the session's lifecycle ---------------------------------------------------------------------------

    def restored(self, step: int | None, seconds: float, parts: dict[str, float]) -> None:
        if self.ledger is not None:
            self.ledger.restored(step, seconds, parts)

    def start(self) -> None:
        """Training begins: startup ends in the ledger, and the run so far is read from it."""
        self._started = True
        if self.ledger is not None:
            self.ledger.startup_done()
            self._read_prior()
        self._stall_seen = self._manager.stats.stall_s

    def batch_in_hand(self, wait_s: float | None, samples: int, *, infer_wait: bool) -> None:
        """A step's batch arrived after ``wait_s`` (None with ``infer_wait``: the gap since the last boundary,
        less what saves blocked and pauses took)."""
        now = time.perf_counter()
        if wait_s is None and infer_wait and self._gap_from is not None:
            t0, stalled, paused = self._gap_from
            wait_s = max(0.0, now - t0 - (self.stalled_s - stalled) - (self._paused_s - paused))
        if wait_s is not None:
            self.data_wait_s += wait_s
            if self.ledger is not None:
                self.ledger.data_wait(wait_s)
            if self.data is not None and self._batch_t is not None:
                self.data.record(wait_s, now - self._batch_t, samples)
        self._batch_t = now

    def step_begins(self) -> None:
        if self.ledger is not None:
            self.ledger.step_begin()

    def step_ended(self, step: int) -> None:
        """At a boundary, before its saves: the staging waits since the last one, and the step in the ledger."""
        self.account_stall()
        if self.ledger is not None:
            self.ledger.step_end(step)

    def boundary_done(self, step: int, ended: float) -> None:
        self._boundary_step = step
        self._gap_from = (ended, self.stalled_s, self._paused_s)

    def boundary_took(self, seconds: float) -> None:
        """A boundary ran inside the loader's ``next()`` (Accelerate's): not data wait."""
        self._inside_s += seconds

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside is not data wait (validation between steps)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - start

    def emergency_save(self, step: int, seconds: float, *, fault: str, fault_step: int) -> None:
        """A stop's emergency save of ``step`` took ``seconds``, after ``fault`` at ``fault_step``."""
        if self.ledger is not None:
            self.ledger.fault(fault, fault_step)
            self.ledger.emergency(seconds, f"emergency save of step {step}")

    def survivor_save(self, outcome: SurvivorOutcome, lost: str, ended: str) -> None:
        """The survivors saved after losing peers (``lost`` says which); the incarnation ends with ``ended``."""
        if self.ledger is not None:
            self.ledger.fault(lost, outcome.step)
            self.ledger.emergency(outcome.seconds, f"survivor save of step {outcome.step}")
            self.ledger.end(ended)

    def note(self, kind: str, **fields: Any) -> None:
        """An event of the run for ``resilience report`` (a straggler), written by the main process."""
        if self.ledger is not None:
            self.ledger.note(kind, **fields)

    def end(self, closing_s: float, reason: str, *, stopped: bool) -> None:
        """The session ends with ``reason`` after ``closing_s`` of last writes: an emergency's after a stop,
        checkpoint stall otherwise."""
        self.flush_telemetry()
        if self.ledger is not None:
            if stopped:
                self.ledger.emergency(closing_s, "the stop's last writes and uploads")
            else:
                self.account_stall()
                self._stall(closing_s)
            self.ledger.end(reason[:300])
        if self.telemetry is not None:
            self._manager.remove_listener(self.telemetry)
            self.telemetry.close()

    # ---- checkpoint stall ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Time inside counts as checkpoint stall (nested uses count once)."""
        self._blocking_depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._blocking_depth -= 1
            if self._blocking_depth == 0:
                self._stall_seen = self._manager.stats.stall_s  # the manager's share is in this span
                self._stall(time.perf_counter() - start)

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """Saves inside are not checkpoint stall: their time goes to a bucket of its own (an emergency's)."""
        self._blocking_depth += 1
        try:
            yield
        finally:
            self._blocking_depth -= 1
            self._stall_seen = self._manager.stats.stall_s

    def account_stall(self) -> None:
        """Staging waits before optimizer steps (outside any save) since the last boundary."""
        if self._blocking_depth:
            return
        total = self._manager.stats.stall_s
        waited, self._stall_seen = total - self._stall_seen, total
        if waited > 0:
            self._stall(waited)

    def _stall(self, seconds: float) -> None:
        self.stalled_s += seconds
        if self.ledger is not None and self._started:
            self.ledger.checkpoint_stall(seconds, self._boundary_step)
        self._on_stall(seconds)

    # ---- data wait -----------------------------------------------------------------------------------------

    def timed(self, loader: Iterable[T], settings: Any = None) -> TimedIterator[T]:
        """``loader``, timing each ``next()`` less the boundary's own time inside it; see
        :meth:`resilience.session.TrainingSession.timed`."""
        if self.data is None:
            raise ConfigError("timing the data loader needs the goodput ledger: turn goodput on")
        if settings is not None:
            self.data.watch(settings)
        return TimedIterator(loader, _LessBoundary(self), on_wait=self._fetched)

    def _fetched(self, wait_s: float) -> None:
        """One ``next()`` returned after ``wait_s``, of which the boundary took ``_inside_s``."""
        self._fetch_inside_s, self._inside_s = self._inside_s, 0.0
        waited = max(0.0, wait_s - self._fetch_inside_s)
        self.data_wait_s += waited
        if self.ledger is not None:
            self.ledger.data_wait(waited)

    def _fetch_recorded(self, wait_s: float, step_s: float, samples: int) -> None:
        self._inside_s = 0.0  # a fetch begins: boundary time from outside a timed fetch is not this one's
        assert self.data is not None
        self.data.record(max(0.0, wait_s - self._fetch_inside_s), step_s, samples)

    # ---- metrics -------------------------------------------------------------------------------------------

    def flush_telemetry(self) -> None:
        if self.telemetry is not None:
            for metrics in self.telemetry.drain():
                self._emit(metrics)

    def _window(self, window: DataWindow) -> None:
        self._emit({**window.metrics(), **self.metrics()})

    def metrics(self) -> dict[str, float]:
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
        assert self.ledger is not None and self.config is not None
        if not self._is_main or not any(ledger_dir(self.config.run_dir).glob("incarnation-*.jsonl")):
            return
        self.ledger.flush()
        try:
            self._prior = summarize(self.config.run_dir)
        except Exception as exc:  # accounting must never stop training
            log.warning("goodput: could not read the run's ledger: %s", exc)
            return
        live = self.ledger.metrics()
        self._prior_marks = {b: live.get(f"goodput/{b}_s", 0.0) for b in self._prior.buckets}

    def run_so_far(self) -> tuple[float, int] | None:
        """The run's uptime (the finished incarnations', and this one's so far) and its failures, as the ledger
        told them at the start; None without them (no earlier incarnation, or not the main process)."""
        prior = self._prior
        if prior is None:
            return None
        finished = sum(inc.uptime_s for inc in prior.incarnations[:-1])
        return finished + time.time() - prior.incarnations[-1].start, prior.failures


class _LessBoundary:
    """The data-wait monitor as :class:`TimedIterator` sees it: each wait less the boundary's time inside it."""

    def __init__(self, goodput: SessionGoodput):
        self._goodput = goodput

    def record(self, wait_s: float, step_s: float, samples: int = 0) -> None:
        self._goodput._fetch_recorded(wait_s, step_s, samples)


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()
