"""Preemption as schedulers and launchers deliver it: the stop signal reaches every process of the job.

SLURM signals every process of a job step, torchrun and ``accelerate launch`` each worker's process group, a
terminal the foreground process group, Kubernetes the container's first process. So the signal also reaches the
pack's checkpoint helpers and the data loader's workers, not only the rank a test would choose. Each case here
sends it that way to a real 2-rank job and checks that the step the ranks agreed on is committed and verifies,
that every rank exits with the requeue code (75), and that no process of the job outlives it. Also: a signal
while a relaunch restores, and the launcher's closing SIGTERM while the interpreter shuts down.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from resilience.cli import main as resilience_cli
from tests.helpers import ROOT, WORKERS, accelerate_launch, base_env, free_port, kill_job

LIGHTNING = WORKERS / "lightning_train.py"
ACCELERATE = WORKERS / "accelerate_train.py"
TIMEOUT_S = 180
AGREED = re.compile(r"rank (\d): all ranks save step (\d+) and stop \(exit code 75\)")


def family(proc: subprocess.Popen[str]) -> list[int]:
    """The job's processes: the one started and all its descendants (ranks, helpers, loader workers)."""
    try:
        return [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return [proc.pid]


def deliver(proc: subprocess.Popen[str], how: str, signum: signal.Signals) -> list[int]:
    """Send ``signum`` the way ``how`` names: ``group`` (the process group, as torchrun and a terminal do),
    ``every_pid`` (each process, as SLURM does) or ``first`` (the process started, as Kubernetes does)."""
    pids = family(proc)
    if how == "group":
        os.killpg(proc.pid, signum)  # started with start_new_session: its group id is its pid
    elif how == "every_pid":
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
    else:
        proc.send_signal(signum)
    return pids


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"not reached (exit {proc.poll()}):\n{log.read_text()[-6000:]}")
        time.sleep(0.05)


def assert_none_left(pids: list[int]) -> None:
    """No process of the job outlives it: the helpers end with their training process."""
    deadline = time.monotonic() + 15
    while True:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left:
            return
        assert time.monotonic() < deadline, f"outlived the job: {[psutil.Process(p).cmdline()[:3] for p in left]}"
        time.sleep(0.1)


def assert_agreed_step_committed(output: str, root: Path) -> int:
    agreed = {int(rank): int(step) for rank, step in AGREED.findall(output)}
    assert sorted(agreed) == [0, 1] and len(set(agreed.values())) == 1, output[-6000:]
    step = agreed[0]
    for rank in (0, 1):
        assert f"rank {rank}: emergency save of step {step} committed locally" in output, output[-6000:]
    assert (root / f"step-{step}" / "manifest.json").exists()
    assert resilience_cli(["verify", str(root), "--step", str(step)]) == 0
    return step


def start_job(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """The job in a session of its own (so its process group is its own), its output to ``log``."""
    with log.open("w") as sink:
        return subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )


def stop_when(
    proc: subprocess.Popen[str],
    log: Path,
    marker: Path,
    how: str,
    signum: signal.Signals = signal.SIGTERM,
    timeout_s: float = TIMEOUT_S,
    lines: int = 0,
) -> tuple[list[int], str]:
    """Once ``marker`` exists (and holds ``lines`` distinct lines), send ``signum`` to the job as ``how`` says
    (:func:`deliver`); wait up to ``timeout_s`` for it to end. The job's pids and output."""

    def reached() -> bool:
        return marker.exists() and len(set(marker.read_text().split())) >= lines

    try:
        wait_for(reached, proc, log)
        pids = deliver(proc, how, signum)
        proc.wait(timeout=timeout_s)
    finally:
        kill_job(proc)
    return pids, log.read_text()


def start_lightning(root: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], Path]:
    root.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(LIGHTNING), "--root", str(root), "--devices", "2", "--health", *args]
    return start_job(command, root / "job.log", base_env(env)), root / "job.log"


@pytest.mark.parametrize(
    ("how", "signum", "workers", "where"),
    [
        # torchrun's and a terminal's way; the loader's workers get it too, within a step and after its boundary
        ("group", signal.SIGTERM, 2, "in_step"),
        ("group", signal.SIGTERM, 2, "after_boundary"),
        ("every_pid", signal.SIGINT, 0, "in_step"),  # SLURM's way (srun forwards Ctrl-C as SIGINT)
        pytest.param("every_pid", signal.SIGUSR1, 2, "after_boundary", marks=pytest.mark.slow),  # --signal=USR1
    ],
)
def test_lightning_ddp_commits_the_agreed_step_when_every_process_is_signalled(
    tmp_path: Path, how: str, signum: signal.Signals, workers: int, where: str
) -> None:
    loader = ["--workers", str(workers), "--loader", "plain"] if workers else []
    timing = ["--sleep-after-boundary"] if where == "after_boundary" else []
    proc, log = start_lightning(tmp_path, "--step-sleep", "0.3", "--max-steps", "60", *loader, *timing)
    pids, output = stop_when(proc, log, tmp_path / "ckpt" / "step-8" / "manifest.json", how, signum)
    assert proc.returncode == 75, output[-6000:]
    assert "helper process" not in output, output[-6000:]  # no helper died of the signal
    assert_agreed_step_committed(output, tmp_path / "ckpt")
    assert len(pids) > 2 + 2 * workers  # the helpers (and the workers) were among those signalled
    assert_none_left(pids)


def test_torchrun_forwards_a_sigterm_and_the_lightning_ranks_commit_the_agreed_step(tmp_path: Path) -> None:
    """torchrun's agent gets the SIGTERM (as from a scheduler that signals the launcher only) and sends it to each
    worker's process group (its workers are sessions of their own): their helpers get it too."""
    log = tmp_path / "job.log"
    env = base_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d"]
    command += ["--rdzv_endpoint", f"127.0.0.1:{free_port()}", str(LIGHTNING), "--root", str(tmp_path)]
    command += ["--devices", "2", "--health", "--step-sleep", "0.3", "--max-steps", "60"]
    proc = start_job(command, log, env)
    pids, output = stop_when(proc, log, tmp_path / "ckpt" / "step-8" / "manifest.json", "first")
    assert_agreed_step_committed(output, tmp_path / "ckpt")
    assert output.count("exiting with code 75") == 2 and "helper process" not in output, output[-6000:]
    assert_none_left(pids)


def start_accelerate(tmp: Path, root: Path, **settings: str) -> tuple[subprocess.Popen[str], Path]:
    """A 2-rank ``accelerate launch --multi_gpu`` job on CPU with health on, no settings from the caller's shell."""
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    env.update(HF_HOME=str(tmp / "hf-home"), ACCELERATE_RESILIENCE_LOCAL_ROOT=str(root), **settings)
    return start_job(accelerate_launch(ACCELERATE, str(out)), out / "launch.log", env), out / "launch.log"


def test_accelerate_launch_commits_the_agreed_step_when_every_process_is_signalled(tmp_path: Path) -> None:
    """SLURM's delivery under ``accelerate launch``: the launcher, both workers and their helpers all get SIGTERM at
    once; the launcher's agent also forwards its own to each worker's process group."""
    root = tmp_path / "ckpt"
    health = {"ACCELERATE_RESILIENCE_HEALTH": "1", "ACCELERATE_RESILIENCE_EVERY_N_STEPS": "3"}
    proc, log = start_accelerate(tmp_path, root, TRAIN_STEP_SLEEP="0.3", **health)
    pids, output = stop_when(proc, log, root / "step-3" / "manifest.json", "every_pid")
    step = assert_agreed_step_committed(output, root)
    assert step > 3 and "helper process" not in output, output[-6000:]
    # each worker left with the code the ranks agreed on, not by the launcher's closing signal (-15)
    assert output.count("exiting with code 75") == 2 and "-15" not in output, output[-6000:]
    assert_none_left(pids)


def test_an_accelerate_script_run_bare_commits_the_agreed_step_when_its_group_is_signalled(tmp_path: Path) -> None:
    """``python train.py``, one process with its helpers: a terminal's or a scheduler's signal to the process group
    (SIGINT here, as Ctrl-C sends it)."""
    out, root = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        ACCELERATE_RESILIENCE_LOCAL_ROOT=str(root),
        ACCELERATE_RESILIENCE_HEALTH="1",
        ACCELERATE_RESILIENCE_EVERY_N_STEPS="3",
        ACCELERATE_RESILIENCE_PERSIST="process",  # its small model would persist in threads
        TRAIN_STEP_SLEEP="0.3",
    )
    proc = start_job([sys.executable, str(ACCELERATE), str(out)], out / "run.log", env)
    pids, output = stop_when(proc, out / "run.log", root / "step-3" / "manifest.json", "group", signal.SIGINT)
    assert proc.returncode == 75, output[-6000:]
    agreed = re.search(r"all ranks save step (\d+) and stop \(exit code 75\)", output)
    assert agreed is not None and "helper process" not in output, output[-6000:]
    step = int(agreed.group(1))
    assert step > 3 and f"emergency save of step {step} committed locally" in output, output[-6000:]
    assert resilience_cli(["verify", str(root), "--step", str(step)]) == 0
    assert_none_left(pids)


def test_accelerate_launch_signalled_during_a_restore_exits_75_at_once(tmp_path: Path) -> None:
    """Under Accelerate the stop signals are the pack's from ``attach()``: a restore (here made to take 60 s, inside
    DCP's read, which catches the handlers' ``SystemExit``) ends at once with the requeue code on both workers, and
    the checkpoint it read stays where it was, intact."""
    root = tmp_path / "ckpt"
    first, log = start_accelerate(tmp_path, root, TRAIN_STOP_AT="4")
    assert first.wait(timeout=TIMEOUT_S) == 0, log.read_text()[-6000:]
    marker = tmp_path / "loading"
    slow = {"TEST_SLOW_LOAD_S": "60", "TEST_LOADING_MARKER": str(marker), "TEST_SLOW_LOAD_IN": "shards"}
    proc, log = start_accelerate(tmp_path, root, ACCELERATE_RESILIENCE_HEALTH="1", **slow)
    # once both workers read (one still importing has no handler yet: SIGTERM's default would end it, rightly)
    pids, output = stop_when(proc, log, marker, "every_pid", timeout_s=30, lines=2)
    # each worker says it once, however many copies of the signal reach it (the launcher forwards its own)
    said = re.findall(r"SIGTERM before training began: exiting with code 75 \(pid (\d+)\)", output)
    ours = "\n".join(line for line in output.splitlines() if "resilience" in line or "exitcode" in line)
    assert len(said) == len(set(said)) == 2, ours[-6000:]  # the pack's and the launcher's lines, not a traceback
    assert "exitcode" not in output or "exitcode  : 75" in output, output[-6000:]
    assert_none_left(pids)
    assert resilience_cli(["verify", str(root), "--step", "4"]) == 0
    assert "Skipping" not in output and not (root / "quarantine").exists(), output[-6000:]


def test_resilience_launch_commits_the_agreed_step_when_its_process_group_is_signalled(tmp_path: Path) -> None:
    """Under ``resilience launch`` the ranks and their helpers share the launcher's process group: the launcher
    forwards the signal as well, spares are not started again, and the launcher exits with the ranks' code."""
    log = tmp_path / "launch.log"
    command = [sys.executable, "-m", "resilience.cli", "launch", "--nproc-per-node=2", str(LIGHTNING)]
    command += ["--root", str(tmp_path), "--devices", "2", "--health", "--step-sleep", "0.3", "--max-steps", "60"]
    proc = start_job(command, log, base_env())
    pids, output = stop_when(proc, log, tmp_path / "ckpt" / "step-8" / "manifest.json", "group")
    assert proc.returncode == 75, output[-6000:]
    assert "helper process" not in output, output[-6000:]
    assert_agreed_step_committed(output, tmp_path / "ckpt")
    assert_none_left(pids)


@pytest.mark.parametrize(
    ("where", "how"),
    [
        ("before_the_read", "group"),
        ("in_dcps_read", "group"),
        pytest.param("in_dcps_read", "every_pid", marks=pytest.mark.slow),
    ],
)
def test_a_signal_during_a_restore_exits_75_and_the_checkpoint_stays_intact(
    tmp_path: Path, where: str, how: str
) -> None:
    """A preemption while a relaunch reads its checkpoint (here made to take 60 s, before the read or inside DCP's,
    which catches the handlers' ``SystemExit`` on each rank): nothing is trained yet, so the job leaves at once
    with the requeue code, nothing is set aside, and the next relaunch resumes from the same checkpoint."""
    first, log = start_lightning(tmp_path, "--max-steps", "8")
    assert first.wait(timeout=TIMEOUT_S) == 0, log.read_text()[-6000:]
    marker = tmp_path / "loading"
    slow = {"TEST_SLOW_LOAD_S": "60", "TEST_LOADING_MARKER": str(marker)}
    if where == "in_dcps_read":
        slow["TEST_SLOW_LOAD_IN"] = "shards"
    proc, log = start_lightning(tmp_path, "--max-steps", "12", env=slow)
    # both ranks in the read, well before it would have ended
    pids, output = stop_when(proc, log, marker, how, timeout_s=30, lines=2)
    assert proc.returncode == 75, output[-6000:]
    assert "SIGTERM before training began: exiting with code 75" in output, output[-6000:]
    assert "Skipping" not in output and not (tmp_path / "ckpt" / "quarantine").exists(), output[-6000:]
    assert_none_left(pids)
    assert resilience_cli(["verify", str(tmp_path / "ckpt"), "--step", "8"]) == 0
    again, log = start_lightning(tmp_path, "--max-steps", "12")
    assert again.wait(timeout=TIMEOUT_S) == 0, log.read_text()[-6000:]
    assert "Restored step 8" in log.read_text()


FINALIZING = """
import os, signal, time
from resilience.health import HealthConfig, HealthGuard

class Late:
    def __del__(self):  # runs while the interpreter shuts down, as a launcher's closing SIGTERM may arrive
        os.write(2, b"SIGTERM at shutdown\\n")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)

late = Late()
guard = HealthGuard(HealthConfig(nvml=False, watchdog=False, inject=""))
guard.start()
guard.stop(75)
"""


def test_the_agreed_exit_code_survives_a_sigterm_while_the_interpreter_shuts_down(tmp_path: Path) -> None:
    """CPython puts the default handlers back during shutdown; a signal ignored stays ignored, so the code holds."""
    script = tmp_path / "stop.py"
    script.write_text(FINALIZING)
    env = {**base_env(), "PYTHONPATH": str(ROOT)}  # a whole shutdown, without the suite's fast exit (conftest.py)
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "exiting with code 75" in done.stderr and "SIGTERM at shutdown" in done.stderr, done.stderr[-4000:]
    assert done.returncode == 75, done.stderr[-4000:]
