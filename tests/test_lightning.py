"""The Lightning adapter through real Trainer runs as subprocesses: kill -9 and relaunch, bit-exact resume,
2-rank DDP with every rank writing, corrupt checkpoints skipped, SIGTERM and injected GPU faults, torchrun
restarts, and LightningCLI; in one process, the random numbers after a resume at an epoch end, and which ranks
share the first rank's fork server."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torchdata.stateful_dataloader import StatefulDataLoader

from examples.demo_model import DemoModel, Points
from lightning_resilience import (
    AutoResume,
    PeriodicCheckpoint,
    ResilientCheckpointIO,
    ResilientDDPStrategy,
    ResilientModelParallelStrategy,
)
from resilience.cli import main as resilience_cli
from resilience.persist.fork_server import SHARE_VARIABLE, ForkServer
from tests.helpers import ROOT, WORKERS, base_env, free_port, kill_tree

WORKER = WORKERS / "lightning_train.py"


def train(
    root: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run the worker to completion (or its own death) and return what happened."""
    command = [sys.executable, str(WORKER), "--root", str(root), *args]
    return subprocess.run(
        command, env=base_env(env), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def resilience_json(*args: str) -> Any:
    """The ``resilience`` command's ``--json`` output, run as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "resilience.cli", *args, "--json"],
        cwd=ROOT,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_same_params(a: Path, b: Path) -> None:
    left, right = params(a), params(b)
    assert left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), f"{key} differs from the uninterrupted run"


def steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (root / "ckpt").glob("step-*") if (p / "manifest.json").exists())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Final parameters of an uninterrupted single-process run of 20 steps (2 epochs of 12 batches)."""
    root = tmp_path_factory.mktemp("reference")
    done = train(root, "--out", str(root / "final.pt"))
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "final.pt"


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp-reference")
    done = train(root, "--devices", "2", "--out", str(root / "final.pt"))
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "final.pt"


def test_a_fit_with_data_loader_workers_saves_every_interval_to_the_end(tmp_path: Path) -> None:
    """Each epoch's worker processes are forked from the training process and end with it: the engine they
    inherit must stay the parent's (its helper was closed by the first worker to exit, and a save then hung)."""
    done = train(tmp_path, "--workers", "1", "--max-steps", "36", timeout=120)  # 3 epochs: it hung at step 28
    assert done.returncode == 0, done.stdout + done.stderr
    assert steps(tmp_path) == [28, 32, 36], steps(tmp_path)  # keep_last=3 of every 4 steps


@pytest.mark.parametrize(("kill_at", "resumes_at"), [(10, 8), pytest.param(13, 12, marks=pytest.mark.slow)])
def test_kill_9_and_relaunch_resumes_bit_exact(tmp_path: Path, reference: Path, kill_at: int, resumes_at: int) -> None:
    """Mid-epoch (step 8 of 12 per epoch) and at an epoch end (step 12): same parameters as never stopping."""
    killed = train(tmp_path, "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL
    assert max(steps(tmp_path)) == resumes_at
    resumed = train(tmp_path, "--out", str(tmp_path / "final.pt"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "Restored all states" in resumed.stdout + resumed.stderr
    assert "FINISHED 20 2" in resumed.stdout
    assert_same_params(reference, tmp_path / "final.pt")
    # the resumed run logs the steps it did, numbered where it resumed, not from 0 again
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as handle:
        logged = [int(row["step"]) for row in csv.DictReader(handle) if row.get("train_loss")]
    assert logged == list(range(resumes_at, 20))


class FixedBatches:
    """A training iterable that is no DataLoader: the same batches every epoch, no random number drawn."""

    def __init__(self) -> None:
        self.data = Points()

    def __len__(self) -> int:
        return len(self.data) // 4

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.data), 4):
            yield self.data.x[start : start + 4], self.data.y[start : start + 4]


class TwoLoaders(DemoModel):
    """Trains on a shuffled ``StatefulDataLoader`` (a seed drawn each epoch) and, at once, on a loader whose new
    epoch draws nothing from the global generator."""

    def __init__(self, other: str) -> None:
        super().__init__()
        self.other = other

    def train_dataloader(self) -> dict[str, Any]:
        data = Points()
        if self.other == "iterable":
            other: Any = FixedBatches()
        else:  # its iterator is made once and only reset for the next epoch
            other = StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)
        return {"shuffled": StatefulDataLoader(data, batch_size=4, shuffle=True), "other": other}

    def training_step(self, batch: dict[str, tuple[torch.Tensor, torch.Tensor]], batch_idx: int) -> torch.Tensor:
        return torch.stack([DemoModel.training_step(self, pair, batch_idx) for pair in batch.values()]).sum()


def fit_two_loaders(root: Path, other: str, max_steps: int) -> tuple[pl.Trainer, dict[str, torch.Tensor]]:
    pl.seed_everything(5)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[ResilientCheckpointIO(str(root / "ckpt"))],
        callbacks=[AutoResume(), PeriodicCheckpoint(every_n_steps=4)],
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    model = TwoLoaders(other)
    trainer.fit(model)
    return trainer, model.state_dict()


@pytest.mark.parametrize("other", ["iterable", "persistent-workers"])
def test_a_resume_at_an_epoch_end_replays_only_the_seeds_the_saved_run_drew(tmp_path: Path, other: str) -> None:
    """The saved run's next epoch drew one seed (the shuffled loader's new iterator), not one per loader."""
    _, straight = fit_two_loaders(tmp_path / "straight", other, 20)
    fit_two_loaders(tmp_path / "run", other, 12)  # 12 batches per epoch: saved after the last of epoch 0
    resumed, params = fit_two_loaders(tmp_path / "run", other, 20)
    assert isinstance(resumed.strategy.checkpoint_io, ResilientCheckpointIO)
    assert resumed.strategy.checkpoint_io.resumed_at_epoch_end
    for key, value in straight.items():
        assert torch.equal(value, params[key]), f"{key} differs from the uninterrupted run"


@pytest.mark.parametrize("strategy_class", [ResilientDDPStrategy, ResilientModelParallelStrategy])
def test_the_ranks_lightning_starts_share_the_first_ranks_fork_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy_class: type
) -> None:
    # Lightning's launcher copies this process's environment to the ranks it starts (see test_helper_call.py for
    # how they use the server); under torchrun or SLURM (LOCAL_RANK set) every rank is started apart, with its own.
    monkeypatch.setenv(SHARE_VARIABLE, "")  # unset again after: later tests' processes start their own servers
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    io = ResilientCheckpointIO(str(tmp_path / "ckpt"), persist="process")
    devices = [torch.device("cpu")] * 2

    def configured(cluster_environment: LightningEnvironment, parallel_devices: list[torch.device]) -> str:
        os.environ[SHARE_VARIABLE] = ""
        strategy = strategy_class(checkpoint_io=io)
        strategy.cluster_environment = cluster_environment
        strategy.parallel_devices = parallel_devices
        strategy._configure_launcher()
        return os.environ[SHARE_VARIABLE]

    server = ForkServer.get(early=True)
    assert isinstance(server, ForkServer)
    assert configured(LightningEnvironment(), devices) == server.share
    assert configured(LightningEnvironment(), devices[:1]) == ""  # one process: no rank to start
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert configured(LightningEnvironment(), devices) == ""


def test_first_launch_starts_fresh_quietly(tmp_path: Path) -> None:
    done = train(tmp_path, "--max-steps", "4")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Restoring states" not in output
    assert "no last checkpoint" not in output and "was called without a model" not in output


def test_ckpt_path_last_and_skipping_a_corrupt_newest_checkpoint(tmp_path: Path, reference: Path) -> None:
    train(tmp_path, "--kill-at", "10")
    assert steps(tmp_path) == [4, 8]
    shard = next((tmp_path / "ckpt" / "step-8").glob("__*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a partial write
    resumed = train(tmp_path, "--ckpt-path", "last", "--out", str(tmp_path / "final.pt"))
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    assert "Skipping step 8" in output and "trying step 4" in output
    assert_same_params(reference, tmp_path / "final.pt")  # resumed from step 4 and redid 5..20 exactly


def test_ddp_ranks_write_in_parallel_and_an_injected_xid_stops_both_for_a_bit_exact_resume(
    tmp_path: Path, ddp_reference: Path
) -> None:
    # rank 0 leaves 6 s after rank 1: Lightning's launcher sees rank 1's exit meanwhile, and must not SIGKILL rank 0
    drill = {"RESILIENCE_INJECT": "xid=79@step=6,rank=1", "TEST_SLOW_LEAVE_S": "6"}
    stopped = train(tmp_path, "--devices", "2", "--health", env=drill)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 69, output
    assert output.count("all ranks save step 6 and stop (exit code 69)") == 2
    assert 6 in steps(tmp_path)
    manifest = json.loads((tmp_path / "ckpt" / "step-6" / "manifest.json").read_text())
    by_rank: dict[int, int] = {}
    for entry in manifest["files"]:
        by_rank[entry["rank"]] = by_rank.get(entry["rank"], 0) + entry["size"]
    assert manifest["world_size"] == 2 and set(by_rank) == {0, 1} and all(by_rank.values())
    resumed = train(tmp_path, "--devices", "2", "--health", "--out", str(tmp_path / "final.pt"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_params(ddp_reference, tmp_path / "final.pt")


def best_k_lines(output: str, word: str) -> dict[tuple[int, int], Any]:
    """The worker's ``SAVED rank step {...}`` lines by (rank, step), or ``RESTORED rank {...}`` by (rank, 0)."""
    found = {}
    for line in output.splitlines():
        if line.startswith(f"{word} "):
            parts = line.split(" ", 3 if word == "SAVED" else 2)
            found[(int(parts[1]), int(parts[2]) if word == "SAVED" else 0)] = json.loads(parts[-1])
    return found


def wait_for_exit(root: Path, timeout: float = 120) -> None:
    """Until no process runs with ``root`` on its command line (a rank outliving the launcher that started it)."""
    import psutil

    def running() -> bool:
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if str(root) in " ".join(proc.info["cmdline"] or []):
                    return True
        return False

    deadline = time.monotonic() + timeout
    while running():
        assert time.monotonic() < deadline, f"a process on {root} is still running"
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("stop", "step", "leader"),
    [
        # killed after step 10: the resume is from ModelCheckpoint's save of step 8, rank 0 leading (the xid case
        # runs the same restore of each rank's callbacks with rank 1 leading)
        pytest.param(["--kill-at", "10"], 8, 0, marks=pytest.mark.slow),
        (["--health"], 6, 1),  # rank 0's GPU faults at step 6: it must not be read, so rank 1 leads that save
        # rank 0 is SIGKILLed in step 8: rank 1 alone commits step 7 (a survivor save), from its own state; rank 1
        # leading is the xid case's, rank 0 lost test_survivors.py's and test_inplace.py's
        pytest.param(["--victim", "0:7:kill", "--step-sleep", "0.1"], 7, 1, marks=pytest.mark.slow),
    ],
    ids=["kill-9", "xid-on-rank-0", "rank-0-lost"],
)
def test_ddp_callbacks_that_differ_per_rank_save_and_come_back_as_the_leading_ranks(
    tmp_path: Path, stop: list[str], step: int, leader: int
) -> None:
    """ModelCheckpoint ranks by a metric each rank logs from its own batches, and names its files by it, so its
    best-k state differs per rank in values and in keys; Lightning keeps rank 0's. Every save must commit, and
    a resume gives every rank the state of the rank that led the save: rank 0, unless its GPU must not be read
    or it is lost, then the lowest rank writing."""
    drill = {"RESILIENCE_INJECT": "xid=79@step=6,rank=0"} if "--health" in stop else None
    first = train(tmp_path, "--devices", "2", "--monitor", *stop, env=drill)
    output = first.stdout + first.stderr
    assert first.returncode in (-signal.SIGKILL, 69), output
    wait_for_exit(tmp_path)  # rank 1 outlives a killed rank 0 (the launcher) to make its survivor save
    saved = best_k_lines(output, "SAVED")
    if (0, step) in saved:
        assert saved[(0, step)] != saved[(1, step)], "the ranks' best-k states were meant to differ"
    else:  # rank 0 was lost before it saved: compare with what it held at the save before
        assert saved[(0, 4)] != saved[(1, 4)], "the ranks' best-k states were meant to differ"
    assert steps(tmp_path)[-1] == step, output
    resumed = train(tmp_path, "--devices", "2", "--monitor", *(["--health"] if "--health" in stop else []))
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output
    restored = best_k_lines(output, "RESTORED")
    assert restored[(0, 0)] == restored[(1, 0)] == saved[(leader, step)], (restored, saved[(leader, step)])
    assert output.count("FINISHED 20") == 2


@pytest.mark.parametrize(
    ("how", "extra"),
    [
        # a killed rank's survivor save: also test_survivors.py and under accelerate launch
        ("kill", ["--step-sleep", "0.1"]),
        # a stopped rank, found by the hang watchdog: also test_survivors.py (the engine's same path)
        pytest.param("stop", ["--health", "--hang-min-s", "4", "--step-sleep", "0.1"], marks=pytest.mark.slow),
    ],
    ids=["kill-9-mid-step", "sigstop-mid-step"],
)
def test_ddp_survivor_saves_what_a_lost_rank_leaves_and_the_relaunch_is_bit_exact(
    tmp_path: Path, ddp_reference: Path, how: str, extra: list[str]
) -> None:
    """Rank 1 is lost in step 8 (after ModelCheckpoint's save of step 4): rank 0 commits step 7 from its
    replica, records who wrote it, and exits 75; the relaunch on both ranks ends where an uninterrupted run does."""
    command = [sys.executable, str(WORKER), "--root", str(tmp_path), "--devices", "2", "--victim", f"1:7:{how}", *extra]
    log = tmp_path / "run.log"
    # the save takes 6 s: Lightning's launcher sees the killed rank's exit meanwhile, and must not SIGKILL rank 0
    slow = {"TEST_SLOW_SURVIVOR_S": "6"} if how == "kill" else {}
    with log.open("w") as sink:  # not a pipe: a stopped rank 1 (rank 0's child) would hold it open forever
        proc = subprocess.Popen(
            command, env=base_env(slow), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        proc.wait(timeout=180)
    finally:
        kill_tree(proc)
    output = log.read_text()
    assert proc.returncode == 75, output
    assert "survivor save of step 7 by ranks [0] (lost: [1]): committed" in output
    manifest = json.loads((tmp_path / "ckpt" / "step-7" / "manifest.json").read_text())
    assert manifest["extra"]["survivor_save"] == {"saved_by": [0], "lost": [1]}
    resumed = train(tmp_path, "--devices", "2", "--out", str(tmp_path / "final.pt"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "Restored step 7" in resumed.stdout + resumed.stderr
    assert_same_params(ddp_reference, tmp_path / "final.pt")


def wait_for(predicate, timeout: float, proc: subprocess.Popen[str]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"condition not reached (exit {proc.poll()}):\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.05)


@pytest.mark.parametrize("slow_write", [pytest.param(False, marks=pytest.mark.slow), True])
def test_sigterm_commits_an_emergency_checkpoint_before_exit(tmp_path: Path, reference: Path, slow_write: bool) -> None:
    """SIGTERM to a real training process; with ``slow_write`` it lands while an async save is being written."""
    env = {"TEST_SLOW_WRITE_S": "1.5"} if slow_write else {}
    args = ["--health", "--step-sleep", "0.2", *(["--async-staging"] if slow_write else [])]
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "--root", str(tmp_path), *args],
        env=base_env(env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        marker = tmp_path / "ckpt" / "writing-8" if slow_write else tmp_path / "ckpt" / "step-4" / "manifest.json"
        wait_for(marker.exists, 120, proc)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode == 75, output
    assert "emergency save of step" in output and "committed locally" in output
    saved = steps(tmp_path)
    assert max(saved) > (8 if slow_write else 4), saved
    assert resilience_cli(["verify", str(tmp_path / "ckpt")]) == 0  # nothing half-written was committed
    resumed = train(tmp_path, "--health", "--out", str(tmp_path / "final.pt"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_params(reference, tmp_path / "final.pt")


@pytest.mark.slow  # torchrun's restart on the fault's exit code: also Accelerate's elastic restart test (same agent)
def test_torchrun_restart_cycle_after_an_injected_fault(tmp_path: Path, ddp_reference: Path) -> None:
    """One launch: the fault stops both ranks (exit 69), torchrun restarts them, they resume and finish."""
    env = base_env({"RESILIENCE_INJECT": "xid=79@step=6,rank=0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{free_port()}",
        str(WORKER),
        "--root",
        str(tmp_path),
        "--devices",
        "2",
        "--health",
        "--out",
        str(tmp_path / "final.pt"),
    ]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "exit code 69" in output and "Restored all states" in output and "FINISHED 20" in output
    assert_same_params(ddp_reference, tmp_path / "final.pt")


def test_lightning_cli_fit_stop_fit_again_resumes(tmp_path: Path) -> None:
    """The example config, as a user runs it: a fault drill stops the run, the same command resumes it."""
    command = [
        sys.executable,
        str(ROOT / "examples" / "lightning_cli.py"),
        "fit",
        "--config",
        str(ROOT / "examples" / "lightning_cli.yaml"),
        "--trainer.max_steps",
        "30",
    ]
    first = subprocess.run(
        command,
        cwd=tmp_path,
        env=base_env({"RESILIENCE_INJECT": "xid=79@step=12,rank=1"}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert first.returncode == 69, first.stdout + first.stderr
    run = tmp_path / "runs" / "lightning-cli"
    assert (run / "checkpoints" / "step-12" / "manifest.json").exists()
    second = subprocess.run(
        command, cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=300, check=False
    )
    output = second.stdout + second.stderr
    assert second.returncode == 0, output
    assert "Restored all states" in output and "max_steps=30` reached" in output
    durable = {row["step"]: row for row in resilience_json("ls", f"file://{run}/durable") if row["committed"]}
    assert 20 in durable and durable[20]["world_size"] == 2, durable  # ModelCheckpoint's step-20 save, uploaded
    assert (run / "goodput").is_dir()
    summary = resilience_json("report", str(run))
    assert summary["failures"] == 1 and len(summary["incarnations"]) == 2
    resumed = summary["incarnations"][1]["recovery"]  # the relaunch's way back to training, split into its parts
    assert all(resumed[part] > 0 for part in ("startup_s", "discover_s", "verify_s", "read_s", "first_step_s"))
