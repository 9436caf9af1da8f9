"""The NVML monitor against scripted NVML answers that raise the real pynvml exception classes.

Only NVML is faked, at the call boundary (SimulatedNVML carries the real module's constants and errors);
the monitor thread, the event log and the fault table are the real ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pynvml
import pytest

from resilience.health import FaultTable, HealthMonitor, Kind, Severity, SimulatedNVML
from resilience.health.events import EventLog


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Counting:
    """An NVML answer that counts its calls."""

    def __init__(self, answer: Any):
        self.answer = answer
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer(self.calls) if callable(self.answer) else self.answer


@pytest.fixture
def sim() -> SimulatedNVML:
    return SimulatedNVML(pynvml)


@pytest.fixture
def events() -> EventLog:
    return EventLog(rank=3)


@pytest.fixture
def start(sim: SimulatedNVML, events: EventLog) -> Iterator[Callable[..., HealthMonitor]]:
    monitors: list[HealthMonitor] = []

    def starter(table: FaultTable | None = None) -> HealthMonitor:
        monitor = HealthMonitor(sim, events, table or FaultTable(), [0], poll_interval_s=0.01)
        assert monitor.start()
        monitors.append(monitor)
        return monitor

    yield starter
    for monitor in monitors:
        monitor.close()


def polls(sim: SimulatedNVML) -> Counting:
    """Make one always-supported query count, so a test can wait for a number of polls."""
    counter = Counting(0)
    sim.answers["nvmlDeviceGetRetiredPagesPendingStatus"] = counter
    return counter


def test_xid_events_get_the_table_severity(sim: SimulatedNVML, events: EventLog, start: Callable) -> None:
    start()
    for xid in (79, 13, 45):
        sim.push_event(pynvml.nvmlEventTypeXidCriticalError, xid)
    assert events.wait_for({Kind.XID}, 2, timeout=5)
    by_xid = {e.xid: e for e in events.events}
    assert by_xid[79].severity is Severity.FATAL and "fallen off the bus" in by_xid[79].detail
    assert by_xid[79].rank == 3 and by_xid[79].device == 0
    assert by_xid[13].severity is Severity.DEGRADED
    assert by_xid[45].severity is Severity.OK
    assert {e.xid for e in events.unhandled()} == {79, 13}, "ignored XIDs are recorded but never acted on"


def test_double_bit_ecc_event_is_fatal_and_reported_once(sim: SimulatedNVML, events: EventLog, start: Callable) -> None:
    errors = Counting(lambda n: 2 if n < 3 else 3)  # baseline 2, then one more uncorrected error
    sim.answers["nvmlDeviceGetTotalEccErrors"] = errors
    start()
    sim.push_event(pynvml.nvmlEventTypeDoubleBitEccError)
    assert events.wait_for({Kind.ECC_DOUBLE_BIT}, 0, timeout=5)
    assert wait_until(lambda: errors.calls >= 5)
    ecc = [e for e in events.events if e.kind is Kind.ECC_DOUBLE_BIT]
    assert len(ecc) == 1 and ecc[0].severity is Severity.FATAL


def test_uncorrected_ecc_counter_increase_is_fatal(sim: SimulatedNVML, events: EventLog, start: Callable) -> None:
    sim.answers["nvmlDeviceGetTotalEccErrors"] = Counting(lambda n: 2 if n < 3 else 3)
    start()
    assert events.wait_for({Kind.ECC_DOUBLE_BIT}, 0, timeout=5)
    (event,) = events.events
    assert event.severity is Severity.FATAL and "2 -> 3" in event.detail


def test_gpu_is_lost_on_any_call_is_fatal(sim: SimulatedNVML, events: EventLog, start: Callable) -> None:
    rows = Counting(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST))
    sim.answers["nvmlDeviceGetRemappedRows"] = rows
    start()
    assert events.wait_for({Kind.GPU_LOST}, 0, timeout=5)
    time.sleep(0.05)
    (event,) = events.events
    assert event.severity is Severity.FATAL and event.device == 0
    assert rows.calls == 1, "a lost GPU is not polled again"


def test_lost_gpu_during_event_wait(sim: SimulatedNVML, events: EventLog, start: Callable) -> None:
    start()
    sim.lost = True
    assert events.wait_for({Kind.GPU_LOST}, 0, timeout=5)
    assert events.events[0].severity is Severity.FATAL


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [(None, Severity.DEGRADED), ({"kind": {"remapped_rows_pending": "fatal"}}, Severity.FATAL)],
)
def test_remapped_rows_pending_follows_the_table(
    sim: SimulatedNVML, events: EventLog, start: Callable, overrides: dict | None, expected: Severity
) -> None:
    sim.answers["nvmlDeviceGetRemappedRows"] = (0, 1, 1, 0)
    start(FaultTable(overrides))
    assert events.wait_for({Kind.REMAPPED_ROWS_PENDING}, 0, timeout=5)
    assert events.events[0].severity is expected
    assert not any(e.kind is Kind.REMAPPED_ROWS_FAILURE for e in events.events)


def test_thermal_slowdown_is_degraded_and_reported_again_only_after_clearing(
    sim: SimulatedNVML, events: EventLog, start: Callable
) -> None:
    hot = pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap
    # hot for 5 polls, cool for 5, hot again
    sim.answers["nvmlDeviceGetCurrentClocksEventReasons"] = Counting(lambda n: hot if n <= 5 or n > 10 else 0)
    counter = polls(sim)
    start()
    assert wait_until(lambda: counter.calls >= 14)
    thermal = [e for e in events.events if e.kind is Kind.THERMAL_SLOWDOWN]
    assert len(thermal) == 2
    assert all(e.severity is Severity.DEGRADED for e in thermal)
    assert len(events.events) == 2, "a software power cap is normal operation, not a fault"


def test_recovery_action_field_where_the_driver_has_it(sim: SimulatedNVML, events: EventLog, start: Callable) -> None:
    if not hasattr(pynvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"):  # e.g. 12.535.77, the floor; the monitor skips it
        pytest.skip("this nvidia-ml-py has no recovery-action field to answer with")
    value = pynvml.c_nvmlFieldValue_t()
    value.fieldId = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    value.nvmlReturn = pynvml.NVML_SUCCESS
    value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    value.value.uiVal = pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    sim.answers["nvmlDeviceGetFieldValues"] = [value]
    start()
    assert events.wait_for({Kind.RECOVERY_ACTION}, 0, timeout=5)
    (event,) = events.events
    assert event.severity is Severity.FATAL and "node reboot" in event.detail


def test_not_supported_answers_are_skipped_quietly(
    sim: SimulatedNVML, events: EventLog, start: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    rows = Counting(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED))
    sim.answers["nvmlDeviceGetRemappedRows"] = rows
    old_driver = pynvml.c_nvmlFieldValue_t()
    old_driver.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
    fields = Counting([old_driver])
    sim.answers["nvmlDeviceGetFieldValues"] = fields
    counter = polls(sim)
    with caplog.at_level(logging.WARNING):
        start()
        assert wait_until(lambda: counter.calls >= 5)
    assert rows.calls == 1 and fields.calls == 1, "an unsupported query is not asked again"
    assert events.events == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_other_nvml_errors_warn_once_and_keep_polling(
    sim: SimulatedNVML, events: EventLog, start: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    rows = Counting(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN))
    sim.answers["nvmlDeviceGetRemappedRows"] = rows
    with caplog.at_level(logging.WARNING):
        start()
        assert wait_until(lambda: rows.calls >= 3)
    warnings = [r.getMessage() for r in caplog.records if "nvmlDeviceGetRemappedRows" in r.getMessage()]
    assert len(warnings) == 1 and "will keep trying" in warnings[0]
    assert events.events == []


def test_a_malformed_answer_does_not_kill_the_monitor(
    sim: SimulatedNVML, events: EventLog, start: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    sim.answers["nvmlDeviceGetRemappedRows"] = Counting(lambda n: (0, 1) if n == 1 else (0, 0, 0, 1))
    with caplog.at_level(logging.ERROR):
        start()
        assert events.wait_for({Kind.REMAPPED_ROWS_FAILURE}, 0, timeout=5)
    assert "GPU health check failed; retrying" in caplog.text and "ValueError" in caplog.text


def test_no_nvml_driver_gives_one_notice_and_no_thread(events: EventLog, caplog: pytest.LogCaptureFixture) -> None:
    monitor = HealthMonitor(pynvml, events, FaultTable(), [0])  # the real module; this machine has no driver
    with caplog.at_level(logging.WARNING):
        assert monitor.start() is False
    (record,) = caplog.records
    assert "NVML is not available (NVMLError_LibraryNotFound" in record.getMessage()
    assert "signals and the hang watchdog still work" in record.getMessage()
    assert not monitor.running
    monitor.close()


def test_nvidia_ml_py_missing_gives_one_notice(events: EventLog, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert HealthMonitor(None, events, FaultTable(), [0]).start() is False
    (record,) = caplog.records
    assert "nvidia-ml-py is not installed" in record.getMessage()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LOCAL_RANK": "1"}, [1]),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5,6"}, [5]),
        ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "2"}, [2]),
        ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-8a1b,GPU-77c0"}, ["GPU-8a1b"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
    ],
)
def test_default_devices_follow_local_rank_and_visible_devices(env: dict, expected: list) -> None:
    from resilience.health.nvml import default_devices

    assert default_devices(env) == expected
