"""The SLURM recipes for Accelerate (examples/slurm/), run here without SLURM: tasks started the way srun starts
them (its environment variables), a real ``accelerate launch`` whose agent turns the workers' 75 into 1, and the
requeue decision with a stand-in ``scontrol``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, base_env, free_port, kill_tree

SLURM = ROOT / "examples" / "slurm"


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """An ``scontrol`` that records its arguments, and the file it records them in."""
    log = tmp_path / "scontrol.log"
    tool = tmp_path / "scontrol"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    tool.chmod(0o755)
    return tool, log


def code_after(exits: Path, launcher: str = "1") -> str:
    ran = subprocess.run([str(SLURM / "worker_code.sh"), str(exits), launcher], capture_output=True, text=True)
    return ran.stdout.strip()


def test_srun_tasks_run_accelerate_without_the_launcher_and_exit_with_the_preemption_code(tmp_path: Path) -> None:
    """Two tasks as srun starts them, each ``task_env.sh python accelerate_train.py``: Accelerate sees a 2-process
    job, a SIGTERM to rank 1 at step 3 makes both save step 3 and exit 75, and requeue.sh requeues on that code."""
    port = free_port()
    tasks = []
    for rank in range(2):
        env = base_env(
            {
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS": "2",
                "SLURM_TASKS_PER_NODE": "2(x1)",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RESILIENCE_INJECT": "signal=SIGTERM@step=3,rank=1",
            }
        )
        command = [str(SLURM / "task_env.sh"), sys.executable, str(ROOT / "examples" / "accelerate_train.py")]
        command += ["--cpu", "--ckpt", str(tmp_path / "ckpt"), "--epochs", "1", "--every", "100"]
        tasks.append(
            subprocess.Popen(
                command,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    try:
        outputs = [task.communicate(timeout=240)[0] for task in tasks]
    finally:
        for task in tasks:
            kill_tree(task)
    assert [task.returncode for task in tasks] == [75, 75], "\n".join(outputs)
    manifest = json.loads((tmp_path / "ckpt" / "step-3" / "manifest.json").read_text())
    assert manifest["world_size"] == 2  # one job of two processes, not two jobs of one

    scontrol, log = fake_scontrol(tmp_path)
    env = {**os.environ, "SCONTROL": str(scontrol), "SLURM_JOB_ID": "4242"}
    for code in ("75", "69", "1", "0"):
        subprocess.run([str(SLURM / "requeue.sh"), code], env=env, check=True, capture_output=True)
    assert log.read_text().splitlines() == ["requeue 4242", "requeue 4242"]  # 75 and 69 only


# Under load (a full 2-worker run) one worker once recorded 143, a SIGTERM from the agent before its own exit:
# slow until that is understood; the single-srun recipe runs by default.
@pytest.mark.slow
def test_accelerate_launch_loses_the_workers_code_and_the_recorded_one_restores_it(tmp_path: Path) -> None:
    exits = tmp_path / "exit-codes"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--main_process_port", str(free_port()), "--no_python", str(SLURM / "record_exit.sh")]
    launch += [sys.executable, "-c", "import sys; sys.exit(75)"]  # a training command stopped by a preemption
    env = base_env({"ACCELERATE_USE_CPU": "true", "RESILIENCE_EXIT_DIR": str(exits)})
    ran = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 1, ran.stdout + ran.stderr  # the agent's code, whatever the workers' were
    assert sorted(p.read_text().strip() for p in exits.iterdir()) == ["75", "75"]
    assert code_after(exits) == "75"
    (exits / "rank-1").write_text("69\n")  # one worker saw a GPU fault: that decides
    assert code_after(exits) == "69"
    assert code_after(tmp_path / "none") == "1"  # nothing recorded: the launcher's code stands


def test_record_exit_passes_signals_to_the_worker_and_records_its_own_code(tmp_path: Path) -> None:
    worker = "\n".join(
        (
            "import signal, sys, time",
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))",  # a worker that saves and stops
            "print('up', flush=True)",
            "time.sleep(60)",
        )
    )
    env = {**os.environ, "RESILIENCE_EXIT_DIR": str(tmp_path), "RANK": "3"}
    proc = subprocess.Popen(
        [str(SLURM / "record_exit.sh"), sys.executable, "-c", worker],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # what the agent sends on a preemption
        assert proc.wait(timeout=30) == 75
    finally:
        kill_tree(proc)
    assert (tmp_path / "rank-3").read_text().strip() == "75"
