"""Which step boundaries run the health agreement (``check_every_n_steps``), decided alike on every rank."""

from __future__ import annotations

import pytest

from resilience.health.schedule import MAX_GAP_S, MAX_STEPS, SHARE, CheckSchedule


def test_a_fixed_number_checks_its_multiples_only() -> None:
    schedule = CheckSchedule(4, planned=[5])
    assert [s for s in range(1, 13) if schedule.due(s)] == [4, 8, 12], "a fixed cadence is kept, drills wait for it"


def test_auto_checks_the_first_boundary_then_the_agreed_ones_and_every_drill() -> None:
    schedule = CheckSchedule("auto", planned=[7, 30])
    checked = []
    for step in range(1, 60):
        if schedule.due(step):
            checked.append(step)
            schedule.agreed(step, 20, cost_s=0.003)  # as the guard does at each check
    assert checked == [1, 7, 27, 30, 50], "the first boundary, the drills' steps, and 20 steps after each check"


def test_auto_alone_checks_every_boundary() -> None:
    schedule = CheckSchedule("auto", alone=True)
    schedule.agreed(1, 500, cost_s=0.0)
    assert all(schedule.due(s) for s in range(2, 20))


@pytest.mark.parametrize(
    ("pace_s", "cost_s", "expected"),
    [
        (0.002, 0.003, 150),  # a small model's step: the check would cost 150% of it
        (0.5, 0.001, 1),  # a large model's step: the check is 0.2% of it, every step
        (0.010, 0.020, int(MAX_GAP_S / 0.010)),  # no more than MAX_GAP_S of steps between two checks
        (1e-6, 0.003, MAX_STEPS),
    ],
)
def test_auto_proposes_steps_for_the_check_to_cost_its_share(pace_s: float, cost_s: float, expected: int) -> None:
    schedule = CheckSchedule("auto")
    assert schedule.proposal(10, 100.0) == 1, "no pace measured yet"
    schedule.agreed(10, 1, cost_s)
    assert schedule.proposal(20, 100.0 + 10 * pace_s) == pytest.approx(expected, abs=1)  # ceil of a float
    if 1 < expected < MAX_STEPS and expected != int(MAX_GAP_S / pace_s):
        assert cost_s / (expected * pace_s) == pytest.approx(SHARE, rel=0.01)
