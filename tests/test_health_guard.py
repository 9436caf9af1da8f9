"""The step-boundary guard: decisions in one process, the emergency save, and agreement across real ranks."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.health import (
    Action,
    FaultEvent,
    HealthConfig,
    HealthGuard,
    Kind,
    Severity,
    SimulatedNVML,
    emergency_save,
)
from tests.helpers import WORKERS, run_ranks


@pytest.fixture
def make_guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., HealthGuard]]:
    monkeypatch.delenv("RESILIENCE_INJECT", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    guards: list[HealthGuard] = []

    def make(nvml: object = None, **config: object) -> HealthGuard:
        config.setdefault("watchdog", False)
        guard = HealthGuard(HealthConfig(poll_interval_s=0.02, devices=[0], **config), nvml=nvml)  # type: ignore[arg-type]
        guards.append(guard.start())
        return guard

    yield make
    for guard in guards:
        guard.close()


def test_no_nvml_is_said_once_per_node(
    make_guard: Callable[..., HealthGuard], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No driver holds for the whole node: its first rank says so, the others only at DEBUG (1,024 ranks, 128
    lines, not 1,024)."""
    caplog.set_level(logging.DEBUG, logger="resilience")
    monkeypatch.setenv("LOCAL_RANK", "1")
    make_guard()
    notices = [r for r in caplog.records if "GPU health is not monitored" in r.getMessage()]
    assert [r.levelno for r in notices] == [logging.DEBUG] and "on this node" in notices[0].getMessage()


def test_no_nvml_still_handles_signals(
    make_guard: Callable[..., HealthGuard], caplog: pytest.LogCaptureFixture
) -> None:
    guard = make_guard()  # the real pynvml module: no driver on this machine
    assert guard.monitor is not None and not guard.monitor.running
    assert sum("GPU health is not monitored" in r.getMessage() for r in caplog.records) == 1
    assert guard.on_step(1).action is Action.CONTINUE
    os.kill(os.getpid(), signal.SIGTERM)
    decision = guard.on_step(2)
    assert decision.stop and decision.severity is Severity.PREEMPTION and decision.exit_code == 75
    assert decision.fault_time == decision.events[0].time <= time.time()
    assert "received SIGTERM" in decision.reason and decision.source_rank == 0


def test_degraded_warns_once_and_training_continues(make_guard: Callable[..., HealthGuard]) -> None:
    sim = SimulatedNVML(pynvml)
    sim.answers["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.nvmlClocksEventReasonHwThermalSlowdown
    seen: list[FaultEvent] = []
    guard = make_guard(sim, save_on_degraded=True)
    guard.add_listener(seen.append)
    assert guard.events.wait_for({Kind.THERMAL_SLOWDOWN}, 0, timeout=5)
    warn = guard.on_step(1)
    assert warn.action is Action.WARN and warn.save and not warn.stop and warn.exit_code is None
    assert "thermal slowdown" in warn.reason
    assert guard.on_step(2).action is Action.CONTINUE, "a degraded fault is warned about once"
    assert guard.events.counts[Kind.THERMAL_SLOWDOWN.value] == 1
    assert seen == [], "listeners added later see later events only"
    sim.answers["nvmlDeviceGetCurrentClocksEventReasons"] = 0  # clears, then comes back: a new event
    time.sleep(0.1)
    sim.answers["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert guard.events.wait_for({Kind.THERMAL_SLOWDOWN}, 1, timeout=5)
    assert [e.kind for e in seen] == [Kind.THERMAL_SLOWDOWN]


def test_fatal_outranks_degraded_and_is_checked_every_n_steps(make_guard: Callable[..., HealthGuard]) -> None:
    sim = SimulatedNVML(pynvml)
    guard = make_guard(sim, check_every_n_steps=4)
    sim.push_event(pynvml.nvmlEventTypeXidCriticalError, 13)
    sim.push_event(pynvml.nvmlEventTypeXidCriticalError, 95)
    assert guard.events.wait_for({Kind.XID}, 1, timeout=5)
    assert [guard.on_step(s).action for s in (1, 2, 3)] == [Action.CONTINUE] * 3
    decision = guard.on_step(4)
    assert decision.stop and decision.severity is Severity.FATAL and decision.exit_code == 69
    assert [e.xid for e in decision.events] == [95]


def test_misuse_is_explained(make_guard: Callable[..., HealthGuard]) -> None:
    guard = make_guard()
    with pytest.raises(ValueError, match="no stop decision yet"):
        guard.stop()
    with pytest.raises(RuntimeError, match="before start"):
        guard.inject("ecc@step=1")
    with pytest.raises(RuntimeError, match="needs start"):
        HealthGuard(HealthConfig(inject="")).on_step(1)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[CheckpointManager]:
    durable = f"memory://health/{tmp_path.name}"
    with CheckpointManager(CheckpointConfig(local_root=tmp_path / "local", durable_url=durable)) as m:
        yield m


def test_emergency_save_commits_within_grace_and_reports_timings(manager: CheckpointManager, tmp_path: Path) -> None:
    fault_time = time.time() - 0.5
    result = emergency_save(
        manager, 7, {"w": torch.ones(3)}, {"rng": torch.zeros(2)}, grace_s=20, fault_time=fault_time
    )
    assert result.error is None and result.local_committed and result.durable_committed
    assert result.fault_to_local_s is not None and 0.5 <= result.fault_to_local_s <= result.fault_to_durable_s  # type: ignore[operator]
    assert result.block_s is not None and not result.already_saved
    assert (tmp_path / "local" / "step-7" / "manifest.json").exists()
    again = emergency_save(manager, 7, {"w": torch.ones(3)}, grace_s=20)
    assert again.already_saved and again.local_committed and again.error is None


def test_emergency_save_after_the_grace_period_says_so(manager: CheckpointManager) -> None:
    result = emergency_save(manager, 3, {"w": torch.ones(2**20)}, grace_s=1, fault_time=time.time() - 60)
    assert not result.local_committed and result.fault_to_local_s is None


def test_two_ranks_agree_to_save_and_stop_at_the_injected_step(tmp_path: Path) -> None:
    results = run_ranks(
        WORKERS / "health_agree.py", [str(tmp_path)], 2, timeout=60, env={"RESILIENCE_INJECT": "xid=79@step=5,rank=1"}
    )
    reports = {}
    for r in results:
        assert r.returncode == 69, f"rank {r.rank} exited {r.returncode}:\n{r.output[-4000:]}"
        assert "forcing exit 69" in r.output, "the stuck non-daemon thread was outlived by the forced exit"
        (line,) = [x for x in r.output.splitlines() if x.startswith("RESULT ")]
        reports[r.rank] = json.loads(line[len("RESULT ") :])
    for report in reports.values():
        assert report["step"] == 5 and report["severity"] == "FATAL" and report["source_rank"] == 1
        assert report["exit_code"] == 69 and report["local_committed"] and report["fault_to_local_s"] >= 0
    assert "XID 79" in reports[1]["reason"]
    assert reports[0]["reason"] == "rank 1 reported a fatal fault"
    assert (tmp_path / "step-5" / "manifest.json").exists()


def test_a_guard_for_another_fit_makes_its_watcher_exit_at_once_again_until_training_begins() -> None:
    """The health callback keeps one watcher for all its fits: the second fit's set-up and restore are again
    before training, where a stop signal exits at once (nothing trained yet to save)."""
    from resilience.health import FaultTable, SignalWatcher
    from resilience.health.events import EventLog

    watcher = SignalWatcher(["SIGUSR2"], EventLog(rank=0), FaultTable(), exit_code=75)
    watcher.record()  # the first fit trained
    guard = HealthGuard(HealthConfig(nvml=False, watchdog=False, inject=""), signals=watcher)
    try:
        assert not watcher.recording
        guard.start()
        assert watcher.recording
    finally:
        guard.close()


def test_fast_steps_are_checked_at_the_same_few_boundaries_and_a_signal_stops_both_ranks_at_one() -> None:
    """With ``check_every_n_steps="auto"`` (the default), steps much shorter than the check's all-reduce are not
    each paid for with one; the ranks still check at the same boundaries (a mismatch would raise or hang), and a
    SIGTERM that reaches rank 0 at step 400 and rank 1 at step 410 stops both at one step, no earlier than 400."""
    results = run_ranks(WORKERS / "health_schedule.py", ["3000", "400", "410"], 2, timeout=60)
    reports = []
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}:\n{r.output[-4000:]}"
        (line,) = [x for x in r.output.splitlines() if x.startswith("RESULT ")]
        reports.append(json.loads(line[len("RESULT ") :]))
    assert reports[0] == reports[1], reports
    assert reports[0]["stopped"] is not None and reports[0]["stopped"] >= 400
    assert reports[0]["agreements"] < reports[0]["stopped"] / 10, "nearly every step was checked"
