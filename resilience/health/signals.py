"""Preemption signals as fault events, with no work done inside the handler.

The handler only appends to a deque: appending is atomic and takes no lock, whereas logging or taking the
event log's lock inside a handler can deadlock against the very code the signal interrupted. The guard
drains the deque at the next step boundary, where saving is safe.
"""

from __future__ import annotations

import collections
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from resilience.errors import ConfigError
from resilience.health.events import EventLog
from resilience.health.faults import FaultEvent, FaultTable, Kind


def parse_signal(value: str | int) -> signal.Signals:
    """``"SIGTERM"``, ``"term"``, ``15`` or ``signal.SIGTERM`` -> ``signal.SIGTERM``."""
    text = str(int(value)) if isinstance(value, int) else str(value).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ConfigError(f"unknown signal {value!r}: use a name such as SIGTERM or SIGUSR1, or a number") from None


class SignalWatcher:
    """Records the configured signals; call :meth:`install` from the main thread, :meth:`restore` to undo.

    Args:
        signals: Names or numbers, e.g. ``("SIGTERM", "SIGUSR1")``.
        events: Where :meth:`drain` reports them.
        table: Severity of a signal (``kind.signal``, preemption by default).
        chain: Also call the Python handler that was installed before (e.g. a framework's own).
    """

    def __init__(self, signals: Sequence[str | int], events: EventLog, table: FaultTable, *, chain: bool = False):
        self.signals = [parse_signal(s) for s in signals]
        self.events = events
        self.table = table
        self.chain = chain
        self._received: collections.deque[tuple[int, float]] = collections.deque()
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "signal handlers can only be installed from the main thread: start the health guard there"
            )
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received.append((signum, time.time()))
        previous = self._previous.get(signal.Signals(signum))
        if self.chain and callable(previous):
            previous(signum, frame)

    def drain(self) -> list[FaultEvent]:
        """Report the signals received since the last call (on the calling thread)."""
        reported = []
        while self._received:
            signum, at = self._received.popleft()
            name = signal.Signals(signum).name
            reported.append(self.events.report(Kind.SIGNAL, self.table.kind(Kind.SIGNAL), f"received {name}", at=at))
        return reported
