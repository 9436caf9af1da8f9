"""Hang detection: one step far longer than usual is reported while it is still running.

A collective that never completes blocks the training thread, so nothing on that thread can notice; this
watchdog's thread can, and its warning names the rank, which is what one needs to find the bad node among
thousands. The work per step is one append and a median of at most ``window`` floats.

A hang that goes on ``stuck_s`` past its report is no longer a slow step: a collective with a peer cut off, a
storage mount that stopped answering, a store that never replies. Nothing on the training thread can end it, so
the watchdog hands it to ``on_stuck`` (the session ends the process, for a restart from the last checkpoint).

A hang is one long step. A rank persistently slower than its peers (a straggler) makes every rank's steps
longer alike, so no single step stands out here: :mod:`resilience.health.stragglers` compares the ranks for that.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from resilience.health.events import EventLog
from resilience.health.faults import FaultTable, Kind


class HangWatchdog:
    """Reports (once per step) a step running longer than ``factor`` x the running median and ``min_s``.

    Args:
        events: Where the ``hang`` event goes (logged as a warning with the rank).
        table: Severity of a hang (``kind.hang``, degraded by default).
        factor: Multiple of the median step time that counts as a hang.
        min_s: Floor of the threshold, so fast steps with jitter do not warn.
        min_samples: Steps measured before judging (the first steps include warm-up and compilation).
        window: Steps in the running median.
        stuck_s: Seconds a reported hang may go on before ``on_stuck`` is told (None: never).
        on_stuck: Called once per step, from the watchdog's thread, with the seconds since the step began and the
            step that last finished.
    """

    def __init__(
        self,
        events: EventLog,
        table: FaultTable,
        *,
        factor: float = 5.0,
        min_s: float = 10.0,
        min_samples: int = 5,
        window: int = 100,
        stuck_s: float | None = None,
        on_stuck: Callable[[float, int], None] | None = None,
    ):
        self.events = events
        self.table = table
        self.factor = factor
        self.min_s = min_s
        self.min_samples = min_samples
        self._durations: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self._last: float | None = None
        self._step: int | None = None
        self._limit: float | None = None
        self._median = 0.0
        self._flagged: int | None = None
        self.stuck_s = stuck_s
        self._on_stuck = on_stuck
        self._escalated: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resilience-hang-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)

    def on_step(self, step: int) -> None:
        """Mark a step boundary (the step that just finished)."""
        now = time.monotonic()
        with self._lock:
            if self._last is not None:
                self._durations.append(now - self._last)
            self._last, self._step = now, step
            if len(self._durations) >= self.min_samples:
                self._median = statistics.median(self._durations)
                self._limit = max(self.factor * self._median, self.min_s)

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Not a step: validation or a blocking save between steps would otherwise look like a hang."""
        with self._lock:
            self._last = None
        try:
            yield
        finally:
            with self._lock:
                self._last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.min_s / 4)):
            self._check()

    def _check(self) -> None:
        with self._lock:
            if self._last is None or self._limit is None:
                return
            elapsed = time.monotonic() - self._last
            if self._flagged == self._step:
                self._escalate(elapsed)
                return
            if elapsed <= self._limit:
                return
            self._flagged = self._step
            step, limit, median = self._step, self._limit, self._median
        self.events.report(
            Kind.HANG,
            self.table.kind(Kind.HANG),
            f"{elapsed:.1f} s since step {step} finished, over the limit of {limit:.1f} s "
            f"({self.factor:g} x median step {median:.3g} s): a hang seen from this rank (it, or a peer it waits "
            "for, may be stuck)",
        )

    def _escalate(self, elapsed: float) -> None:
        """Under the lock: a reported hang that went on ``stuck_s`` more goes to ``on_stuck`` (once per step)."""
        assert self._limit is not None and self._step is not None
        if self.stuck_s is None or self._on_stuck is None or self._escalated == self._step:
            return
        if elapsed > self._limit + self.stuck_s:
            self._escalated = self._step
            threading.Thread(
                target=self._on_stuck, args=(elapsed, self._step), name="resilience-stuck", daemon=True
            ).start()
