"""``ResilientModelParallelStrategy`` through real Trainer runs on CPU ranks (gloo, Lightning re-running the worker
for rank 1): FSDP2 (``fully_shard``), tensor parallel (``parallelize_module``) and HSDP applied in
``configure_model``. A kill -9 and relaunch resumes bit-exact; checkpoints reshard between layouts (the resumed
parameters and optimizer state, gathered, equal the saved ones exactly); the names are Lightning sharded
checkpoints that Lightning's own ``ModelParallelStrategy`` and ``consolidate_checkpoint`` read; under HSDP the
survivor of a killed rank saves its chunks from the other replica.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI

from examples.demo_model import DemoData, DemoModel
from lightning_resilience import ResilientCheckpointIO, ResilientModelParallelStrategy
from tests.helpers import ROOT, WORKERS, base_env

WORKER = WORKERS / "lightning_sharded.py"
NAME_8 = "epoch=1-step=8.ckpt"  # 6 batches per epoch per data-parallel rank

pytestmark = pytest.mark.timeout(900)


def train(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(WORKER), "--root", str(root), *args]
    return subprocess.run(
        command, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def finished(done: subprocess.CompletedProcess[str], steps: int) -> str:
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert f"FINISHED {steps}" in done.stdout, output[-6000:]
    return output


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in (root / "ckpt").glob("step-*/manifest.json"))


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal tensor for tensor (parameters, optimizer moments and steps, scheduler), keys included."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), f"{where} differs"
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}/{i}")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted FSDP2 run on 2 ranks (dp=2): full states at steps 4, 8 and after step 20."""
    root = tmp_path_factory.mktemp("sharded-reference")
    done = train(root, "--out", str(root / "final.pt"), "--snapshot-at", "4", "8", "--snapshots", str(root))
    finished(done, 20)
    return root


def test_fsdp2_kill_9_and_relaunch_resumes_bit_exact(tmp_path: Path, reference: Path) -> None:
    killed = train(tmp_path, "--kill-at", "10")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert committed(tmp_path) == [4, 8]
    manifest = json.loads((tmp_path / "ckpt" / "step-8" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {f["rank"] for f in manifest["files"] if f["kind"] == "shard"} == {0, 1}

    resumed = train(tmp_path, "--out", str(tmp_path / "final.pt"), "--restored", str(tmp_path / "restored.pt"))
    output = finished(resumed, 20)
    assert "Restored step 8 from the local tier" in output
    assert_same(load(tmp_path / "restored.pt"), load(reference / "snapshot-8.pt"))
    assert_same(load(tmp_path / "final.pt"), load(reference / "final.pt"))
    # a name the killed run may not have written yet is there after the relaunch, as Lightning's own layout
    assert (tmp_path / "names" / NAME_8 / "meta.pt").is_file() and (tmp_path / "names" / NAME_8 / ".metadata").is_file()


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        pytest.param(("fsdp", 2, 1), ("fsdp", 1, 1), marks=pytest.mark.slow),
        pytest.param(("fsdp", 1, 1), ("fsdp", 2, 1), marks=pytest.mark.slow),
        (("fsdp", 2, 1), ("tp", 1, 2)),
        # HSDP's save and same-layout resume: test_hsdp_survivor_...; resharding by default: dp2-to-tp2
        pytest.param(("hsdp", 2, 1), ("fsdp", 2, 1), marks=pytest.mark.slow),
    ],
    ids=["dp2-to-dp1", "dp1-to-dp2", "dp2-to-tp2", "hsdp-to-dp2"],
)
def test_reshard_between_layouts(tmp_path: Path, saved: tuple[str, int, int], resumed: tuple[str, int, int]) -> None:
    """Saved at step 8 on one layout, resumed (AutoResume) on another: the resumed parameters, Adam moments and
    steps, and scheduler equal the saved ones exactly; training then goes on to the end."""

    def layout(kind: str, dp: int, tp: int) -> list[str]:
        return ["--layout", kind, "--dp", str(dp), "--tp", str(tp)]

    first = train(tmp_path, *layout(*saved), "--max-steps", "8", "--snapshot-at", "8", "--snapshots", str(tmp_path))
    finished(first, 8)
    manifest = json.loads((tmp_path / "ckpt" / "step-8" / "manifest.json").read_text())
    assert manifest["world_size"] == saved[1] * saved[2]
    second = train(tmp_path, *layout(*resumed), "--max-steps", "12", "--restored", str(tmp_path / "restored.pt"))
    output = finished(second, 12)
    assert "Restored step 8" in output
    assert_same(load(tmp_path / "restored.pt"), load(tmp_path / "snapshot-8.pt"))


def test_hsdp_survivor_saves_a_lost_ranks_chunks_from_its_replica(tmp_path: Path) -> None:
    """HSDP, 2 replicas of 1 shard: rank 1 dies (SIGKILL) as step 11 begins; rank 0, in FSDP's collectives with
    it, saves step 10 alone, rank 1's chunks from its own replica (the fault model's survivor save), and exits 75;
    the relaunch resumes from it bit-exact against an uninterrupted HSDP run."""
    reference = tmp_path / "reference"
    finished(train(reference, "--layout", "hsdp", "--out", str(reference / "final.pt")), 20)
    run = tmp_path / "run"
    lost = train(run, "--layout", "hsdp", "--lose-rank-1-at", "10")
    assert lost.returncode == 75, (lost.stdout + lost.stderr)[-6000:]
    manifest = json.loads((run / "ckpt" / "step-10" / "manifest.json").read_text())
    assert manifest["extra"]["survivor_save"] == {"saved_by": [0], "lost": [1]}
    assert {f["rank"] for f in manifest["files"] if f["kind"] == "shard"} == {0}
    # the lost rank's RNG and data position, from the boundary state it published: without them, no exact resume
    assert "rank-1.json" in {f["path"] for f in manifest["files"]}, "rank 1 left no boundary state of step 10"
    output = finished(train(run, "--layout", "hsdp", "--out", str(run / "final.pt")), 20)
    assert "Restored step 10" in output
    assert_same(load(run / "final.pt"), load(reference / "final.pt"))


def test_names_are_lightning_sharded_checkpoints(tmp_path: Path, reference: Path) -> None:
    """Each name is a directory in Lightning's sharded layout, made of hard links to the committed step's shards.

    Lightning's own ``ModelParallelStrategy`` resumes from it and ``consolidate_checkpoint`` turns it into one file.
    """
    names = trained_with_retention(tmp_path)
    assert sorted(p.name for p in names.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=12.ckpt", NAME_8]
    step_dir = tmp_path / "ckpt" / "step-8"
    for shard in step_dir.glob("__*_*.distcp"):
        assert (names / NAME_8 / shard.name).stat().st_ino == shard.stat().st_ino, "shards are linked, not copied"

    stock = tmp_path / "stock"
    restored = stock / "r.pt"
    done = train(stock, "--stock", "--max-steps", "10", "--ckpt-path", str(names / NAME_8), "--restored", str(restored))
    finished(done, 10)
    assert_same(load(restored), load(reference / "snapshot-8.pt"))

    consolidated = tmp_path / "consolidated.pt"
    consolidate = [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint", str(names / NAME_8)]
    subprocess.run(
        [*consolidate, "--output_file", str(consolidated)],
        env=base_env(),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    full = load(consolidated)
    snapshot = load(reference / "snapshot-8.pt")
    assert full["global_step"] == 8 and full["training-resilience"]["step"] == 8
    assert_same(full["state_dict"], snapshot["model"])
    assert_same(full["optimizer_0"]["state"], snapshot["optimizer"]["state"])
    assert full["optimizer_0"]["param_groups"][0]["lr"] == snapshot["optimizer"]["param_groups"][0]["lr"]


@pytest.mark.slow  # the same fallback for Lightning files runs by default (test_lightning_names.py)
def test_a_sharded_name_whose_step_retention_deleted_still_loads(tmp_path: Path, reference: Path) -> None:
    """Through the pack's strategy, as the Lightning directory it is."""
    names = trained_with_retention(tmp_path)
    old = tmp_path / "old"
    done = train(
        tmp_path, "--max-steps", "6", "--ckpt-path", str(names / "epoch=0-step=4.ckpt"), "--restored", str(old / "r.pt")
    )
    finished(done, 6)
    assert_same(load(old / "r.pt"), load(reference / "snapshot-4.pt"))


def trained_with_retention(root: Path) -> Path:
    """12 steps, names every 4, the engine keeping 2: the name of step 4 outlives its step. Returns the names."""
    finished(train(root, "--max-steps", "12", "--keep-last", "2"), 12)
    assert committed(root) == [8, 12], "retention keeps the 2 newest steps"
    return root / "names"


def test_selected_by_name_by_class_and_by_class_path_in_lightning_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-cli"])  # LightningCLI reads it as well as args
    io = ResilientCheckpointIO(str(tmp_path / "a"))
    by_name = Trainer(strategy="resilient_model_parallel", plugins=[io], accelerator="cpu", devices=1, logger=False)
    assert isinstance(by_name.strategy, ResilientModelParallelStrategy) and by_name.strategy.checkpoint_io is io
    by_class = Trainer(strategy=ResilientModelParallelStrategy(), accelerator="cpu", devices=1, logger=False)
    assert isinstance(by_class.strategy.checkpoint_io, ResilientCheckpointIO)
    config = {
        "class_path": "lightning_resilience.ResilientModelParallelStrategy",
        "init_args": {
            "data_parallel_size": 1,
            "tensor_parallel_size": 1,
            "checkpoint_io": {
                "class_path": "lightning_resilience.ResilientCheckpointIO",
                "init_args": {"local_root": str(tmp_path / "b"), "async_staging": True},
            },
        },
    }
    cli = LightningCLI(
        DemoModel,
        DemoData,
        run=False,
        args={"trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "strategy": config}},
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ResilientModelParallelStrategy)
    assert (
        strategy.checkpoint_io.config.local_root == str(tmp_path / "b") and strategy.checkpoint_io.config.async_staging
    )
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        ResilientModelParallelStrategy(save_distributed_checkpoint=False)
