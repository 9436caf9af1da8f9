"""Stragglers: the ``slow=`` drill, the comparison of the ranks' split step times, and a real 2-rank job where the
drill's rank is named (in the logs, the metrics and ``resilience report``) and the other never is."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resilience.errors import ConfigError
from resilience.health import Injection, InjectionSyntaxError, parse_injections
from resilience.health.stragglers import CollectiveWait, SlowDrill, Split, StragglerConfig, judge
from tests.helpers import base_env
from tests.test_inplace import accelerate

pytestmark = pytest.mark.timeout(300)


def resilience_report(run_dir: Path, *options: str) -> str:
    """What ``resilience report`` prints for ``run_dir``, as a user runs it."""
    command = [sys.executable, "-m", "resilience.cli", "report", str(run_dir), *options]
    return subprocess.run(command, env=base_env(), capture_output=True, text=True, check=True).stdout


def test_slow_parses_with_a_factor_and_rejects_one_that_does_not_slow() -> None:
    assert parse_injections("slow=2.5@step=100,rank=1") == [Injection("slow", 100, 1, factor=2.5)]
    assert str(Injection("slow", 3, 1, factor=2.0)) == "slow=2@step=3,rank=1"
    bad = (
        ("slow@step=1", "needs a factor"),
        ("slow=1.0@step=1", "above 1"),
        ("slow=x@step=1", "needs a factor"),
        ("slow=inf@step=1", "finite"),
    )
    for text, message in bad:
        with pytest.raises(InjectionSyntaxError, match=message):
            parse_injections(text)


def test_the_drill_slows_its_rank_from_its_step_and_never_in_a_run_resumed_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("resilience.health.stragglers.time.sleep", slept.append)
    plan = parse_injections("slow=3@step=2,rank=1")
    drill = SlowDrill(plan, rank=1, start_step=0)
    for step in (1, 2, 3):
        drill.at_boundary(step, 0.1 + (slept[-1] if slept else 0.0))  # each step: 0.1 s, and the last sleep
    assert slept == pytest.approx([0.2, 0.2])  # (3 - 1) x the step's own 0.1 s, from step 2 on
    SlowDrill(plan, rank=0).at_boundary(5, 0.1)
    resumed = SlowDrill(plan, rank=1, start_step=2)
    resumed.at_boundary(3, 0.1)  # a restart resumed at the drill's step: it happened in the run before
    assert len(slept) == 2 and resumed.factor is None
    SlowDrill(parse_injections("slow=2@step=0"), rank=0, start_step=0).at_boundary(1, 0.1)  # from the start
    assert slept[-1] == pytest.approx(0.1)


def test_the_rank_with_the_most_own_time_is_named_with_its_split() -> None:
    # rank 1 computes 40 ms more per step; ranks 0 and 2 wait that long in the all-reduce
    splits = [Split(0.1, 0.01, 0.045), Split(0.1, 0.01, 0.005), Split(0.1, 0.012, 0.044)]
    (slow,) = judge(splits, 20, factor=1.5, min_excess_s=0.002)
    assert slow.rank == 1 and slow.ratio == pytest.approx(0.095 / 0.0555)
    assert slow.extra_compute_s == pytest.approx(0.04, abs=2e-3) and slow.others_wait_s == pytest.approx(0.0445)
    assert "rank 1 is a straggler" in slow.describe()
    assert judge([Split(0.1, 0.0, 0.01), Split(0.1, 0.0, 0.012)], 20, factor=1.5, min_excess_s=0.002) == []
    with pytest.raises(Exception, match="factor above 1"):
        StragglerConfig(factor=1.0)


def test_settings_come_from_the_environment_and_a_bad_one_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENCE_STRAGGLER_WINDOW", "5")
    assert StragglerConfig().window == 5 and StragglerConfig(window=8).window == 8
    monkeypatch.setenv("RESILIENCE_STRAGGLER_FACTOR", "1")
    with pytest.raises(ConfigError, match=r"factor=1.0: use a factor above 1.*RESILIENCE_STRAGGLER_FACTOR"):
        StragglerConfig()
    monkeypatch.delenv("RESILIENCE_STRAGGLER_FACTOR")
    monkeypatch.setenv("RESILIENCE_STRAGGLER_WINDOWZ", "3")
    with pytest.warns(UserWarning, match="did you mean RESILIENCE_STRAGGLER_WINDOW"):
        StragglerConfig()


def test_the_wait_in_collectives_runs_from_the_last_gradient_to_the_update_with_one_hook_kept() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    waits = CollectiveWait()
    try:
        for pause in (0.0, 0.0, 0.05):  # the first step finds the parameters, the second which gradient is last
            model(torch.randn(2, 4)).sum().backward()
            time.sleep(pause)  # where a fast rank waits for the others in DDP's last all-reduce
            optimizer.step()
            optimizer.zero_grad()
        assert waits.take() >= 0.05 and waits.take() == 0.0
        assert sum(hook is not None for hook in waits._grad_hooks) == 1
        # a closure (Lightning's way): the backward inside the step is measured the same way
        optimizer.step(lambda: model(torch.randn(2, 4)).sum().backward())
        assert 0.0 < waits.take() < 0.05
    finally:
        waits.close()


# 2 Accelerate ranks under resilience launch, rank 1 slowed 3x from the start, compared every 4 steps: the job has
# 15 steps, so the two slow windows running must be the first two after the warm-up one, on a busy machine too
SLOWED = {
    "ACCELERATE_RESILIENCE_HEALTH": "1",
    "RESILIENCE_INJECT": "slow=3.0@step=0,rank=1",
    "RESILIENCE_STRAGGLER_WINDOW": "4",
    "RESILIENCE_STRAGGLER_FACTOR": "1.3",  # rank 0 also writes the ledger and the metrics: a little slower
    "TRAIN_STEP_SLEEP": "0.02",
}


def test_a_rank_slowed_by_the_drill_is_named_within_a_few_windows_and_the_other_never(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, output = accelerate(out, **SLOWED)
    assert code == 0, output[-6000:]
    assert "rank 1 is a straggler" in output and "rank 0 is a straggler" not in output, output[-6000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [m for m in metrics if "stragglers/slowest_rank" in m]
    assert windows and all(m["stragglers/slowest_rank"] == 1 for m in windows[1:]), windows
    named = [m["step"] for m in windows if m["stragglers/slow_ranks"] >= 1]
    assert named and named[0] <= 12, windows  # two windows of 4 steps running, after the first (warm-up)
    report = resilience_report(out / "ckpt")
    assert "Stragglers" in report and "rank 1 at" in report and "rank 0 at" not in report, report


def test_with_replace_a_straggler_goes_to_a_warm_spare_and_the_job_ends_bit_exact(tmp_path: Path) -> None:
    code, output = accelerate(tmp_path / "reference")
    assert code == 0, output[-6000:]
    out = tmp_path / "run"
    code, output = accelerate(out, **SLOWED, RESILIENCE_STRAGGLER_REPLACE="1")
    assert code == 0, output[-6000:]
    named = re.findall(r"at step (\d+): rank 1 is a straggler", output)
    assert len(named) == 1 and "rank 0 is a straggler" not in output, output[-6000:]
    step = int(named[0])
    assert "rank 1: a straggler; asking the launcher to replace it with a spare" in output, output[-6000:]
    assert f"survivor save of step {step} by ranks [0] (lost: [1]): committed" in output, output[-6000:]
    resumed = [json.loads(found) for found in re.findall(r"RESUME rank=\d (\{[^{}]*\})", output)]
    assert [r["global_step"] for r in resumed] == [0, 0, step, step], output[-6000:]
    for rank in (0, 1):  # the drill only slowed rank 1: the same samples and parameters as a run without it
        got = torch.load(out / f"final-rank{rank}.pt", weights_only=False)
        want = torch.load(tmp_path / "reference" / f"final-rank{rank}.pt", weights_only=False)
        assert got["indices"] == want["indices"], f"rank {rank} trained on other samples"
        for name, tensor in want["model"].items():
            assert torch.equal(got["model"][name], tensor), f"rank {rank}: {name} differs"
    report = resilience_report(out / "ckpt")
    assert f"step {step}: rank 1 replaced by a spare" in report, report
    as_json = resilience_report(out / "ckpt", "--json")
    first, second = json.loads(as_json)["incarnations"]
    assert [(e["e"], e["rank"], e["step"]) for e in first["stragglers"]] == [
        ("straggler", 1, step),
        ("straggler_replaced", 1, step),
    ]
    assert second["restart"] == "in place" and second["stragglers"] == []
