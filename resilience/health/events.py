"""The one place where the monitor, the signal watcher and the watchdog put what they saw.

Producers run on background threads (or, for signals, on the training thread between steps); the guard
reads at step boundaries. Keeping the "worst unhandled severity" here makes the step-boundary check a
lock and an int, whatever the number of sources.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

from resilience.health.faults import FaultEvent, Kind, Rule, Severity

log = logging.getLogger(__name__)
Listener = Callable[[FaultEvent], None]

_LEVELS = {
    Severity.OK: logging.DEBUG,
    Severity.DEGRADED: logging.WARNING,
    Severity.PREEMPTION: logging.WARNING,
    Severity.FATAL: logging.ERROR,
}


class EventLog:
    """Thread-safe record of fault events with the severity not yet acted on.

    Events the table maps to ``ok`` are recorded too (so a drill can see its fault arrive, and metrics can
    count ignored XIDs) but never raise the pending severity.
    """

    def __init__(self, rank: int, listeners: Iterable[Listener] = ()):
        self.rank = rank
        self.step: int | None = None
        self.listeners: list[Listener] = list(listeners)
        self.counts: Counter[str] = Counter()
        self._events: list[FaultEvent] = []
        self._unhandled: list[FaultEvent] = []
        self._cond = threading.Condition()

    def report(
        self,
        kind: Kind,
        rule: Rule,
        detail: str,
        *,
        device: int | str | None = None,
        xid: int | None = None,
        at: float | None = None,
    ) -> FaultEvent:
        """Record, log and pass on one fault; ``at`` is when it happened if that was earlier than now."""
        event = FaultEvent(
            kind=kind,
            severity=rule.severity,
            detail=f"{detail}: {rule.reason}",
            rank=self.rank,
            step=self.step,
            device=device,
            xid=xid,
            time=at if at is not None else time.time(),
        )
        log.log(
            _LEVELS[event.severity],
            "rank %d: %s fault (%s): %s",
            self.rank,
            event.severity.name.lower(),
            kind.value,
            event.detail,
        )
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                log.exception("health event listener %r failed; the event is still recorded", listener)
        # Recorded last, so whoever waits for the event (a drill's step boundary) also sees it passed on.
        with self._cond:
            self._events.append(event)
            self.counts[kind.value] += 1
            if event.severity > Severity.OK:
                self._unhandled.append(event)
            self._cond.notify_all()
        return event

    @property
    def events(self) -> list[FaultEvent]:
        with self._cond:
            return list(self._events)

    def unhandled(self) -> list[FaultEvent]:
        """Events with a severity above ok that no decision has consumed yet."""
        with self._cond:
            return list(self._unhandled)

    def consume_below(self, severity: Severity) -> None:
        """Forget unhandled events milder than ``severity``: a degraded warning is given once, while a
        fatal fault or a preemption stays until the process stops."""
        with self._cond:
            self._unhandled = [e for e in self._unhandled if e.severity >= severity]

    def wait_for(self, kinds: set[Kind], after: int, timeout: float) -> bool:
        """Wait until an event of one of ``kinds`` is recorded beyond the first ``after`` events."""
        with self._cond:
            return self._cond.wait_for(lambda: any(e.kind in kinds for e in self._events[after:]), timeout)

    def __len__(self) -> int:
        with self._cond:
            return len(self._events)
