"""The hang watchdog with a deliberately slow step; short thresholds, behaviour checked rather than speed."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from resilience.health import FaultTable, HangWatchdog, Kind, Severity
from resilience.health.events import EventLog


@pytest.fixture
def events() -> EventLog:
    return EventLog(rank=5)


@pytest.fixture
def watchdog(events: EventLog) -> Iterator[HangWatchdog]:
    dog = HangWatchdog(events, FaultTable(), factor=3.0, min_s=0.2, min_samples=3, window=10)
    dog.start()
    yield dog
    dog.close()


def run_fast_steps(watchdog: HangWatchdog, events: EventLog, steps: range) -> None:
    for step in steps:
        events.step = step
        watchdog.on_step(step)
        time.sleep(0.01)


def test_slow_step_is_reported_once_with_rank_and_step(
    watchdog: HangWatchdog, events: EventLog, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        run_fast_steps(watchdog, events, range(1, 6))
        assert events.events == [], "steps near the median are not hangs"
        # step 6 is now running and never finishes in time
        assert events.wait_for({Kind.HANG}, 0, timeout=5)
        time.sleep(0.25)
    (event,) = events.events
    assert event.severity is Severity.DEGRADED and event.rank == 5 and event.step == 5
    assert "since step 5 finished" in event.detail and "3 x median" in event.detail
    (record,) = [r for r in caplog.records if "hang" in r.getMessage()]
    assert record.getMessage().startswith("rank 5:")


def test_next_slow_step_is_reported_again(watchdog: HangWatchdog, events: EventLog) -> None:
    run_fast_steps(watchdog, events, range(1, 6))
    assert events.wait_for({Kind.HANG}, 0, timeout=5)
    run_fast_steps(watchdog, events, range(6, 8))
    assert events.wait_for({Kind.HANG}, 1, timeout=5)
    assert [e.step for e in events.events] == [5, 7]


def test_paused_work_between_steps_is_not_a_hang(watchdog: HangWatchdog, events: EventLog) -> None:
    run_fast_steps(watchdog, events, range(1, 6))
    with watchdog.suspended():
        time.sleep(0.35)
    watchdog.on_step(6)
    assert events.events == []


def test_no_judgement_before_enough_samples(watchdog: HangWatchdog, events: EventLog) -> None:
    run_fast_steps(watchdog, events, range(1, 3))
    time.sleep(0.35)
    assert events.events == [], "the first steps include warm-up and compilation"
