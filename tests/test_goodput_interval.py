"""Young/Daly save interval against hand-computed values, and MTBF from the run's own ledger."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from resilience.goodput import AdaptiveInterval, summarize, young_daly_interval
from resilience.goodput.interval import PER_GPU_MTBF_S
from tests.workers.goodput_sim import incarnation


def test_young_daly_by_hand() -> None:
    assert young_daly_interval(10.0, 18_000.0) == pytest.approx(600.0)  # sqrt(2 * 10 * 18000)
    assert young_daly_interval(0.5, 3_600.0) == pytest.approx(60.0)
    assert young_daly_interval(10.0, 18_000.0, min_s=900.0) == 900.0
    assert young_daly_interval(10.0, 18_000.0, max_s=300.0) == 300.0
    with pytest.raises(ValueError, match="mtbf_s"):
        young_daly_interval(1.0, 0.0)


def test_plan_uses_the_median_cost_and_reports_what_it_expects() -> None:
    adaptive = AdaptiveInterval(mtbf_s=18_000.0, min_s=60.0, max_s=7_200.0)
    for cost in (10.0, 12.0, 8.0, 50.0, 10.0):  # one slow save does not swing it
        adaptive.observe_cost(cost)
    plan = adaptive.plan(step_s=1.5)
    assert plan.cost_s == 10.0 and plan.mtbf_source == "given" and not plan.clamped
    assert plan.interval_s == pytest.approx(600.0) and plan.interval_steps == 400
    assert plan.expected_overhead == pytest.approx(10 / 600)
    assert plan.expected_lost_s_per_failure == pytest.approx(300.0)
    # At the optimum, blocking and lost work cost the same: 10/600 + 600/36000.
    assert plan.expected_waste == pytest.approx(2 * 10 / 600)
    assert plan.to_dict()["interval_steps"] == 400
    assert plan.describe().startswith("save every 10 min (400 steps of 1.50 s): a save blocks training 10.00 s")


def test_mtbf_observed_from_the_run_ledger(tmp_path: Path) -> None:
    t = incarnation(tmp_path, 0.0, restore=None, steps=3590, end=None)  # 10 s startup + 3590 steps = 1 h up
    t = incarnation(tmp_path, t + 600.0, restore=3500, steps=3585, end="preempted")
    incarnation(tmp_path, t + 600.0, restore=7000, steps=100, end=None)  # still running
    summary = summarize(tmp_path)
    assert summary.failures == 2
    adaptive = AdaptiveInterval()
    adaptive.observe_ledger(tmp_path)
    adaptive.observe_cost(2.0)
    mtbf, source = adaptive.mtbf()
    assert source == "observed" and mtbf == pytest.approx(summary.uptime_s / 2)
    assert adaptive.plan().interval_s == pytest.approx(math.sqrt(2 * 2.0 * mtbf))


def test_a_run_without_ledger_entries_keeps_the_prior(tmp_path: Path) -> None:
    (tmp_path / "goodput").mkdir()  # the folder of a ledger that has not written an incarnation yet
    adaptive = AdaptiveInterval(world_size=8)
    adaptive.observe_ledger(tmp_path)
    assert adaptive.mtbf() == (pytest.approx(PER_GPU_MTBF_S / 8), "prior")


def test_prior_before_any_failure_and_before_any_save() -> None:
    adaptive = AdaptiveInterval(world_size=1024, min_s=120.0, max_s=3_600.0)
    first = adaptive.plan(step_s=2.0)
    assert first.interval_s == 120.0 and first.cost_s is None and first.interval_steps == 60
    mtbf, source = adaptive.mtbf()
    assert source == "prior" and mtbf == pytest.approx(PER_GPU_MTBF_S / 1024)
    adaptive.observe_run(uptime_s=10 * mtbf, failures=0)  # no failure in a long time: at least that long
    assert adaptive.mtbf() == (pytest.approx(10 * mtbf), "prior")
    adaptive.observe_cost(30.0)
    plan = adaptive.plan()
    assert plan.clamped and plan.interval_s == 3_600.0


def test_plan_metrics_for_loggers() -> None:
    adaptive = AdaptiveInterval(mtbf_s=7_200.0, min_s=1.0)
    adaptive.observe_cost(4.0)
    plan = adaptive.plan(step_s=0.5)
    metrics = plan.metrics(interval_steps=480)
    assert metrics == {
        "checkpoint/interval_steps": 480.0,
        "checkpoint/interval_s": pytest.approx(240.0),
        "checkpoint/expected_overhead": pytest.approx(4.0 / 240.0),
        "checkpoint/expected_lost_s_per_failure": pytest.approx(120.0),
        "checkpoint/mtbf_s": 7_200.0,
    }


def test_the_plan_is_described_in_words_a_user_can_check() -> None:
    """Before a failure the MTBF is a prior, and the text says so; a job that fails more often than it can save
    gets no impossible figure (the first-order formula gives over 100% of the time lost)."""
    planner = AdaptiveInterval(world_size=2, min_s=60)
    first = planner.plan(step_s=0.12).describe()
    assert first.startswith("save in 60 s (500 steps of 0.12 s), to measure what a save costs")
    planner.observe_cost(0.02)
    text = planner.plan(step_s=0.12).describe()
    assert "a prior: one failure per 5.8 GPU-years, Llama 3's rate, over 2 GPUs; no failure in this run" in text
    assert "expected to fail every 2.9 years" in text and "under 0.01% of the time in saves" in text
    planner.observe_run(uptime_s=20.0, failures=1)
    plan = planner.plan(step_s=0.12)
    assert plan.expected_waste > 1 and "%" not in plan.describe().split("Expected:")[1].split(",", 2)[2]
    assert "held at min_interval_s=60" in plan.describe() and "1 failure in 20 s of this run" in plan.describe()
    assert "fails more often than saves can keep up with" in plan.describe()
