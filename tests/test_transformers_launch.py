"""``examples/transformers_trainer.py`` as a user runs it: killed with SIGKILL mid-run, or stopped by SIGTERM on one
rank, then the same command again, in one process and on 2 CPU ranks under torchrun. Every relaunch must end with
the ``FINAL_SHA256`` of an uninterrupted run: weights, optimizer, schedule, RNG and data position all came back.
The runs cross epoch boundaries (32 steps an epoch in one process, 16 on two ranks). Nothing is downloaded.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilience.goodput import summarize
from tests.helpers import ROOT, base_env, free_port, kill_job

EXAMPLE = ROOT / "examples" / "transformers_trainer.py"
STEPS, EVERY = 40, 4
TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(900)


def env(**extra: str) -> dict[str, str]:
    """No ACCELERATE_* settings of the caller's, no Hub access."""
    settings = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    settings.update(HF_HUB_OFFLINE="1", **extra)
    return settings


def command(ckpt: Path, ranks: int) -> list[str]:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    return [*launcher, str(EXAMPLE), "--ckpt", str(ckpt), "--steps", str(STEPS), "--save-every", str(EVERY)]


def start(ckpt: Path, ranks: int, log: Path, **extra: str) -> subprocess.Popen[str]:
    with log.open("a") as out:
        return subprocess.Popen(
            command(ckpt, ranks), env=env(**extra), stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip


def run(ckpt: Path, ranks: int, log: Path, **extra: str) -> int:
    proc = start(ckpt, ranks, log, **extra)
    try:
        return proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no end in {TIMEOUT_S} s:\n{log.read_text()[-6000:]}")
    finally:
        kill_job(proc)


def final_digest(log: Path) -> str:
    lines = log.read_text().strip().splitlines()
    assert lines and lines[-1].startswith("FINAL_SHA256 "), f"the last line is not the digest:\n{lines[-20:]}"
    return lines[-1].split()[1]


def committed(ckpt: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in (ckpt / "resilience").glob("step-*/manifest.json"))


def kill_once_committed(ckpt: Path, ranks: int, log: Path, step: int) -> int:
    """Run until a checkpoint of ``step`` or later is committed, then SIGKILL every process; the newest step."""
    proc = start(ckpt, ranks, log)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(saved >= step for saved in committed(ckpt)):
            assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, f"no step >= {step} was committed in time"
            time.sleep(0.05)
    finally:
        kill_job(proc)
    newest = committed(ckpt)[-1]
    assert newest < STEPS, "the run was not killed mid-run"
    return newest


# one process: a kill -9 and relaunch runs by default in test_transformers_folders.py, a resume that ends with
# the uninterrupted weights in test_transformers_trainer.py
@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.slow), 2], ids=["one-process", "two-ranks"])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    """One uninterrupted run: the number of ranks, and its digest."""
    ranks = int(request.param)
    tmp = tmp_path_factory.mktemp(f"reference-{ranks}")
    assert run(tmp / "ckpt", ranks, tmp / "run.log") == 0, (tmp / "run.log").read_text()[-6000:]
    return ranks, final_digest(tmp / "run.log")


def test_kill_9_mid_run_then_the_same_command_ends_with_the_uninterrupted_weights(
    reference: tuple[int, str], tmp_path: Path
) -> None:
    ranks, digest = reference
    ckpt = tmp_path / "ckpt"
    if ranks > 1:
        # first a preemption drill: SIGTERM to rank 1 at step 10, which no save is due at; both ranks save it and stop
        log = tmp_path / "stopped.log"
        assert run(ckpt, ranks, log, RESILIENCE_INJECT="signal=SIGTERM@step=10,rank=1") != 0
        text = log.read_text()
        for rank in range(ranks):
            assert f"rank {rank}: emergency save of step 10 committed locally" in text, text[-6000:]
        assert len(re.findall(r"exitcode\s*: 75", text)) >= 1, text[-6000:]
        assert committed(ckpt)[-1] == 10
    newest = kill_once_committed(ckpt, ranks, tmp_path / "killed.log", 20 if ranks > 1 else 12)
    log = tmp_path / "resumed.log"
    assert run(ckpt, ranks, log) == 0, log.read_text()[-6000:]
    assert f"Restored step {newest} from the local tier" in log.read_text()
    assert final_digest(log) == digest
    if ranks > 1:  # the goodput ledger: the stop, a kill (no record: downtime), a completed run
        summary = summarize(ckpt)
        assert (summary.incarnations[0].end_reason or "").startswith("stopped, exit code 75")
        assert summary.incarnations[-1].end_reason == "completed"
        assert summary.incarnations[-1].restored_step == newest
