"""Preemption signals: real signals to this process, handlers that only record, chaining and restoring."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest

from resilience.errors import ConfigError
from resilience.health import FaultTable, Kind, Severity, SignalWatcher
from resilience.health.events import EventLog
from resilience.health.signals import parse_signal
from tests.helpers import base_env


@pytest.fixture
def previous() -> Iterator[list[int]]:
    """A Python handler installed before the watcher, as a framework would have; restored afterwards."""
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    original = signal.signal(signal.SIGUSR1, handler)
    yield seen
    signal.signal(signal.SIGUSR1, original)


def test_sigterm_becomes_a_preemption_event_at_the_next_drain() -> None:
    events = EventLog(rank=2)
    watcher = SignalWatcher(["SIGTERM", "SIGUSR1"], events, FaultTable())
    watcher.install()
    try:
        before = time.time()
        os.kill(os.getpid(), signal.SIGTERM)
        assert events.events == [], "the handler records only; the event is made at the step boundary"
        (event,) = watcher.drain()
    finally:
        watcher.restore()
    assert event.kind is Kind.SIGNAL and event.severity is Severity.PREEMPTION
    assert "received SIGTERM" in event.detail and event.rank == 2
    assert before <= event.time <= time.time()
    assert watcher.drain() == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize("chain", [True, False])
def test_previous_handler_is_chained_only_when_asked_and_restored(previous: list[int], chain: bool) -> None:
    original = signal.getsignal(signal.SIGUSR1)
    watcher = SignalWatcher(["USR1"], EventLog(rank=0), FaultTable(), chain=chain)
    watcher.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert len(watcher.drain()) == 1
    finally:
        watcher.restore()
    assert previous == ([signal.SIGUSR1] if chain else [])
    assert signal.getsignal(signal.SIGUSR1) is original


def test_install_off_the_main_thread_says_why() -> None:
    watcher = SignalWatcher(["SIGTERM"], EventLog(rank=0), FaultTable())
    errors: list[BaseException] = []

    def install() -> None:
        try:
            watcher.install()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_signal_names_and_numbers() -> None:
    assert parse_signal("SIGTERM") is signal.SIGTERM
    assert parse_signal("usr1") is signal.SIGUSR1
    assert parse_signal(int(signal.SIGUSR2)) is signal.SIGUSR2
    assert parse_signal(str(int(signal.SIGINT))) is signal.SIGINT
    with pytest.raises(ConfigError, match="unknown signal 'SIGFOO'"):
        parse_signal("SIGFOO")


def test_a_handler_put_back_after_restore_passes_the_signal_on(previous: list[int]) -> None:
    """Lightning keeps the handler it found when a fit began and puts it back when the fit ends, after the guard gave
    its own back: the watcher's handler then acts as the one from before (here a Python handler; for SIG_DFL, the
    default action)."""
    watcher = SignalWatcher(["SIGUSR1"], EventLog(rank=0), FaultTable())
    watcher.install()
    kept = signal.getsignal(signal.SIGUSR1)
    watcher.restore()
    signal.signal(signal.SIGUSR1, kept)  # what Lightning's signal connector does at the end of a fit
    os.kill(os.getpid(), signal.SIGUSR1)
    assert previous == [signal.SIGUSR1] and watcher.drain() == []


def test_a_child_forked_from_the_training_process_is_not_held_by_the_watcher() -> None:
    """A process forked after the watcher took SIGTERM over (a user's fork pool) dies of SIGTERM as it would
    without the pack: a pool's terminate() at exit must not hang on a child that swallowed it."""
    watcher = SignalWatcher(["SIGTERM"], EventLog(rank=0), FaultTable())
    watcher.install()
    try:
        ready, tell = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(tell, b"1")  # a signal that came before the child's interpreter was ready would be dropped
            time.sleep(30)
            os._exit(0)
        os.read(ready, 1)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    finally:
        watcher.restore()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert watcher.drain() == [], "the child's signal is not the training process's"


def test_a_second_signal_inside_the_first_handler_still_says_why_once() -> None:
    """Before training a signal ends the process with the requeue code and one line on stderr. A launcher forwards
    the scheduler's signal, so a second one can arrive while the first is being handled: its handler runs inside
    the first's, at the first Python call after it arrived. Here it arrives as the first reaches the point where
    the signals get ignored; a worker of ``accelerate launch`` under load once left without its line that way. The
    process still exits with the code and says so exactly once."""
    script = textwrap.dedent(
        """
        import os, signal
        from resilience.health import FaultTable, SignalWatcher, signals
        from resilience.health.events import EventLog

        hold, sent = signals.hold_exit_code, []

        def second_signal_first(*args):
            if not sent:
                sent.append(True)
                os.kill(os.getpid(), signal.SIGTERM)  # handled at the next check: inside the first handler
            hold(*args)

        signals.hold_exit_code = second_signal_first
        SignalWatcher(["SIGTERM"], EventLog(rank=0), FaultTable(), exit_code=75).install()
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("still running after SIGTERM")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=base_env(), timeout=60)
    assert done.returncode == 75, done.stderr
    assert done.stderr.count("SIGTERM before training began: exiting with code 75") == 1, done.stderr
