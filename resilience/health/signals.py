"""Preemption signals as fault events, with no work done inside the handler.

Once training runs, the handler only appends to a deque: appending is atomic and takes no lock, whereas logging
or taking the event log's lock inside a handler can deadlock against the very code the signal interrupted. The
guard drains the deque at the next step boundary, where saving is safe.

Before training begins (the framework's set-up, a restore that may read for minutes) there is nothing trained to
save: a stop signal then ends the process at once with the preemption code, so the scheduler requeues it, instead
of killing it by the signal (exit 143, which a requeue-on-75 recipe does not requeue). Reading a checkpoint changes
nothing in it, so leaving mid-read is safe.

Once the exit code is decided, :func:`hold_exit_code` keeps it: CPython puts back the default handlers while the
interpreter shuts down, except where a signal is ignored, so a launcher's closing SIGTERM would otherwise turn the
agreed code into death by signal (-15).
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, NoReturn

from resilience import leaving
from resilience.errors import ConfigError
from resilience.health import loader_workers
from resilience.health.events import EventLog
from resilience.health.faults import FaultEvent, FaultTable, Kind

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2})
"""Signals a scheduler, a launcher or a terminal sends to every process of a job to stop it."""


def parse_signal(value: str | int) -> signal.Signals:
    """``"SIGTERM"``, ``"term"``, ``15`` or ``signal.SIGTERM`` -> ``signal.SIGTERM``."""
    text = str(int(value)) if isinstance(value, int) else str(value).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ConfigError(f"unknown signal {value!r}: use a name such as SIGTERM or SIGUSR1, or a number") from None


def hold_exit_code(
    signals: Sequence[signal.Signals], exit_code: int, timeout_s: float, *, when: str = ""
) -> threading.Timer:
    """From now on the process leaves with ``exit_code``: ``signals`` are ignored (from the main thread; a handler
    left in place would be reset to the default during interpreter shutdown, and the launcher's closing SIGTERM
    would kill the process by the signal), and an ``os._exit`` with the same code ends a teardown or a non-daemon
    thread that holds the process longer than ``timeout_s`` (``when`` says what that moment is, for its line).
    Returns the timer: cancelled, and with :func:`resilience.leaving.cancel`, the process stays after all."""
    leaving.decide(exit_code)
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            signal.signal(signum, signal.SIG_IGN)

    def force() -> None:
        # No logging here: its locks may be held by the very thread that is stuck.
        moment = when or f"{timeout_s:.1f} s after the stop"
        os.write(2, f"resilience: still running {moment}; forcing exit {exit_code}\n".encode())
        os._exit(exit_code)

    timer = threading.Timer(timeout_s, force)
    timer.daemon = True
    timer.start()
    return timer


def _expect_loader_workers_to_die() -> None:
    """A job's stop signal also reaches torch's DataLoader workers. Those the pack could not protect (started
    before it watched the signals, or by a ``spawn`` context: :mod:`~resilience.health.loader_workers`) die of
    it, and torch's SIGCHLD handler in this process would then raise a RuntimeError wherever the training thread
    is, in the emergency save too. Their death is expected now: it is let go. A signal within a step is saved at
    that step's boundary, before the next batch is drawn."""
    handler = signal.getsignal(signal.SIGCHLD)
    if getattr(handler, "__module__", "").startswith("torch.utils.data"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


class SignalWatcher:
    """Records the configured signals; call :meth:`install` from the main thread, :meth:`restore` to undo.

    Args:
        signals: Names or numbers, e.g. ``("SIGTERM", "SIGINT", "SIGUSR1")``.
        events: Where :meth:`drain` reports them (None until a guard adopts the watcher).
        table: Severity of a signal (``kind.signal``, preemption by default).
        chain: Also call the Python handler that was installed before (e.g. a framework's own).
        exit_code: Until :meth:`record` (training has begun), a signal ends the process at once with this code;
            None: always record.
        exit_timeout_s: How long such an exit may take before it is forced (:func:`hold_exit_code`).
    """

    def __init__(
        self,
        signals: Sequence[str | int],
        events: EventLog | None,
        table: FaultTable,
        *,
        chain: bool = False,
        exit_code: int | None = None,
        exit_timeout_s: float = 60.0,
    ):
        self.signals = [parse_signal(s) for s in signals]
        self.events = events
        self.table = table
        self.chain = chain
        self.exit_code = exit_code
        self.exit_timeout_s = exit_timeout_s
        self.recording = exit_code is None
        self._received: collections.deque[tuple[int, float]] = collections.deque()
        self._previous: dict[signal.Signals, Any] = {}
        self._given_back: dict[signal.Signals, Any] = {}
        self._pid = os.getpid()
        self._exiting = False
        self._said = False

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        """Take the signals over, also from a handler installed since (a framework's, e.g. Lightning's, which it
        sets up as training is about to begin); :meth:`restore` gives back the ones from before the first call."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "signal handlers can only be installed from the main thread: start the health guard there"
            )
        self._pid = os.getpid()
        for signum in self.signals:
            if signal.getsignal(signum) != self._handle:
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)
        loader_workers.protect()

    def record(self) -> None:
        """Training has begun: from here on a signal is recorded for the next step boundary, which saves."""
        self.recording = True

    def await_training(self) -> None:
        """Training is to begin again (a second fit with the same callback): until :meth:`record`, a signal ends
        the process at once, as before the first."""
        self.recording = self.exit_code is None

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._given_back.update(self._previous)
        self._previous.clear()
        loader_workers.unprotect()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a child forked from the training process: as if nothing were installed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not self.installed:  # given back, then put in place again by someone who kept it (Lightning does)
            self._pass_on(signal.Signals(signum), frame)
            return
        if not self.recording:
            self._exit_now(signum)
        self._received.append((signum, time.time()))
        _expect_loader_workers_to_die()
        previous = self._previous.get(signal.Signals(signum))
        if self.chain and callable(previous):
            previous(signum, frame)

    def _pass_on(self, signum: signal.Signals, frame: FrameType | None) -> None:
        """After :meth:`restore`, a signal goes where it went before the watcher: to the handler given back, or,
        where that was the default action, to the default action (the process ends by the signal)."""
        previous = self._given_back.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _exit_now(self, signum: int) -> NoReturn:
        """Before training: nothing trained is lost, so leave with the preemption code (``SystemExit``, so that
        ``finally`` blocks and the framework's teardown run).

        A second signal (a launcher forwards the scheduler's) runs this handler again inside the first, at the
        first Python call after it arrived, until the signals are ignored; its ``SystemExit`` then ends the first.
        So each step is done by whichever invocation gets there first, and the line is said exactly once: the flag
        is set with no Python call between it and the write."""
        assert self.exit_code is not None
        name = signal.Signals(signum).name
        said = f"resilience: {name} before training began: exiting with code {self.exit_code} (pid {os.getpid()})\n"
        line = said.encode()  # here, not between the flag and the write: a pending handler may run after any call
        if not self._said:
            self._said = True
            os.write(2, line)
        if not self._exiting:
            hold_exit_code(self.signals, self.exit_code, self.exit_timeout_s)
            self._exiting = True  # after: one cut short by a second signal is done again by that one
        raise SystemExit(self.exit_code)

    def drain(self) -> list[FaultEvent]:
        """Report the signals received since the last call (on the calling thread)."""
        reported: list[FaultEvent] = []
        if self.events is None:
            return reported  # nothing adopted it yet: the signals stay for the guard that will
        while self._received:
            signum, at = self._received.popleft()
            name = signal.Signals(signum).name
            reported.append(self.events.report(Kind.SIGNAL, self.table.kind(Kind.SIGNAL), f"received {name}", at=at))
        return reported
