"""``examples/fabric_train.py`` as users run it: two CPU ranks started by ``fabric.launch()``. A kill -9 of the
whole job and a preemption signal (an agreed save, exit 75) both end, after a relaunch of the same command, with
an uninterrupted run's weights; the ranks write their shares, which one process loads back; the goodput ledger
follows the run across the restart."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from examples.fabric_train import weights_digest
from lightning_resilience.fabric import ResilientCheckpointIO, resume
from resilience.goodput import summarize
from resilience.storage.manifest import Manifest
from tests.helpers import ROOT, base_env, kill_tree

EXAMPLE = ROOT / "examples" / "fabric_train.py"
STEPS = 20
TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(900)


def command(ckpt: Path, *extra: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--ckpt", str(ckpt), "--steps", str(STEPS), *extra]


@contextlib.contextmanager
def started(ckpt: Path, *extra: str) -> Iterator[subprocess.Popen[str]]:
    """The example in a session of its own (its second rank is its child), whose output goes to ``<ckpt>.log``."""
    with open(f"{ckpt}.log", "w") as log:
        proc = subprocess.Popen(
            command(ckpt, *extra), cwd=ROOT, env=base_env(), stdout=log, stderr=log, text=True, start_new_session=True
        )
    try:
        yield proc
    finally:
        kill_tree(proc)
        proc.wait()


def run(ckpt: Path) -> tuple[str, str]:
    """Run the example to its end: (its last line of output, the whole output)."""
    done = subprocess.run(
        command(ckpt), cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout.strip().splitlines()[-1], done.stdout


def committed(ckpt: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / "manifest.json").exists())


def wait_for_step(proc: subprocess.Popen[str], ckpt: Path, step: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not any(saved >= step for saved in committed(ckpt)):
        assert proc.poll() is None, Path(f"{ckpt}.log").read_text()[-6000:]
        assert time.monotonic() < deadline, f"no step >= {step} committed in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """An uninterrupted run: its checkpoint folder and its last line (``FINAL_SHA256 <digest>``)."""
    ckpt = tmp_path_factory.mktemp("reference") / "ckpt"
    last, _ = run(ckpt)
    assert last.startswith("FINAL_SHA256 ")
    return ckpt, last


def stopped_after(ckpt: Path, step: int, stop: Callable[[subprocess.Popen[str]], None]) -> int:
    """Start the example, ``stop`` it once ``step`` is committed; its exit code."""
    with started(ckpt, "--step-sleep", "0.3") as proc:
        wait_for_step(proc, ckpt, step)
        stop(proc)
        return proc.wait(timeout=60)


def test_kill_9_of_the_job_mid_run_and_the_relaunch_ends_with_the_uninterrupted_weights(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    ckpt = tmp_path / "ckpt"
    assert stopped_after(ckpt, 10, lambda proc: os.killpg(proc.pid, signal.SIGKILL)) == -signal.SIGKILL
    newest = max(committed(ckpt))
    assert newest < STEPS, "the job was not killed mid-run"

    last, output = run(ckpt)
    assert f"resumed at step {newest}" in output
    assert last == reference[1]


def test_sigterm_saves_the_step_all_ranks_agree_on_exits_75_and_the_relaunch_ends_exact(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    ckpt = tmp_path / "ckpt"
    # to rank 0 only: rank 1 learns of it at the next step boundary
    assert stopped_after(ckpt, 5, lambda proc: proc.send_signal(signal.SIGTERM)) == 75
    stopped_at = max(committed(ckpt))
    assert stopped_at % 5 != 0 and stopped_at < STEPS, f"step {stopped_at} is no emergency save"

    last, output = run(ckpt)
    assert f"resumed at step {stopped_at}" in output
    assert last == reference[1]
    stopped, resumed = summarize(ckpt).incarnations  # the ledger's default place: the plugin's local_root
    assert (stopped.end_reason or "").startswith("stopped, exit code 75: received SIGTERM")
    assert resumed.restored_step == stopped_at and resumed.last_step == STEPS and resumed.end_reason == "completed"


def test_both_ranks_write_their_shares_and_one_process_loads_them(tmp_path: Path, reference: tuple[Path, str]) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference[0], ckpt)
    where = ckpt / f"step-{STEPS}" / "manifest.json"
    manifest = Manifest.from_json(where.read_bytes(), where=str(where))
    assert manifest.world_size == 2
    assert {f.rank for f in manifest.files if f.path.endswith(".distcp")} == {0, 1}

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[ResilientCheckpointIO(str(ckpt))])
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    resume(fabric, state)
    assert state["step"] == STEPS
    assert f"FINAL_SHA256 {weights_digest(model)}" == reference[1]
