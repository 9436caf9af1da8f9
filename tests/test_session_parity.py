"""One session behind both adapters: the same scenario through Lightning and through Accelerate gives the same
saved steps and the same ledger (interval saves, a preemption drill's emergency save and stop, the resume).

Each framework runs ``tests/workers/parity.py`` twice as a subprocess: first with a SIGTERM drill at step 10
(every rank saves step 10 and exits 75), then the same command again, which resumes at step 10 and finishes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilience.goodput import summarize
from tests.helpers import ROOT, WORKERS, base_env


def run(framework: str, root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKERS / "parity.py"), framework, str(root)],
        cwd=ROOT,
        env=base_env({"RESILIENCE_INJECT": "signal=SIGTERM@step=10"}),
        capture_output=True,
        text=True,
        timeout=240,
    )


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in (root / "ckpt").glob("step-*/manifest.json"))


def account(root: Path) -> dict[str, Any]:
    """What the ledger says, without the wall-clock figures that differ between any two runs."""
    summary = summarize(root)
    incarnations = []
    for inc in summary.incarnations:
        saves = [e["step"] for e in inc.events if e["e"] == "save_local_commit"]
        faults = [(e["step"], "SIGTERM" in e["reason"]) for e in inc.events if e["e"] == "fault"]
        incarnations.append(
            {
                "ended": (inc.end_reason or "").split(":")[0],
                "restored": inc.restored_step,
                "steps": (inc.first_step, inc.last_step),
                "saves": saves,
                "faults": faults,
                "stall": inc.buckets["checkpoint"] > 0,
                "emergency": inc.buckets["emergency"] > 0,
            }
        )
    return {"failures": summary.failures, "incarnations": incarnations}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[int], dict[str, Any]]]:
    found = {}
    for framework in ("lightning", "accelerate"):
        root = tmp_path_factory.mktemp(framework)
        stopped = run(framework, root)
        assert stopped.returncode == 75, stopped.stdout + stopped.stderr
        assert committed(root) == [4, 8, 10], "interval saves, then the drill's emergency save"
        finished = run(framework, root)
        assert finished.returncode == 0 and "FINISHED 12" in finished.stdout, finished.stdout + finished.stderr
        found[framework] = (committed(root), account(root))
    return found


def test_both_frameworks_save_the_same_steps_and_keep_the_same_ledger(
    outcomes: dict[str, tuple[list[int], dict[str, Any]]],
) -> None:
    lightning, accelerate = outcomes["lightning"], outcomes["accelerate"]
    assert lightning[0] == accelerate[0] == [8, 10, 12]  # keep_last=3
    assert lightning[1] == accelerate[1]
    first, second = lightning[1]["incarnations"]
    assert first == {
        "ended": "stopped, exit code 75",
        "restored": 0,  # nothing restored: the summary infers step 0 from the first step done
        "steps": (1, 10),
        "saves": [4, 8, 10],
        "faults": [(10, True)],
        "stall": True,
        "emergency": True,
    }
    assert second["ended"] == "completed" and second["restored"] == 10 and second["saves"] == [12]
    assert second["steps"] == (11, 12) and lightning[1]["failures"] == 1
