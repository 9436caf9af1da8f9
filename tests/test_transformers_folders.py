"""The Trainer's ``output_dir/checkpoint-N`` folders under ``attach_trainer``: made from committed steps, holding what
the Trainer's own save writes (a Trainer without the pack resumes from them exactly), rotated as the Trainer rotates
its own, never half written, never written over a folder the pack did not make. The tiny GPT-2 of
``examples/transformers_trainer.py`` (tied weights, dropout on) on 48 samples: 6 steps an epoch.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback
from transformers.trainer_pt_utils import safe_globals
from transformers.trainer_utils import get_last_checkpoint

from accelerate_resilience import ResiliencePlugin
from accelerate_resilience.transformers import attach_trainer
from examples.transformers_trainer import make_trainer, weights_digest
from resilience.checkpoint.manager import CheckpointManager
from resilience.config import CheckpointConfig
from resilience.errors import ConfigError
from tests.helpers import WORKERS, base_env, free_port, kill_job

STEPS, EVERY, SAMPLES = 14, 3, 48  # saves at 3, 6, 9, 12, 14; save_total_limit=3 keeps 9, 12, 14
PICKLED = ("optimizer.pt", "scheduler.pt", "rng_state.pth")
TEXT = ("trainer_state.json", "config.json", "generation_config.json")
WORKER = WORKERS / "trainer_folders.py"
TIMEOUT_S = 400


class FolderAtSave(TrainerCallback):
    """Notes, at each ``on_save``, whether the step's folder is there with its state."""

    def __init__(self) -> None:
        self.seen: dict[int, bool] = {}

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.seen[state.global_step] = (folder / "trainer_state.json").is_file()


def trainer_in(output_dir: Path, **settings: Any) -> Any:
    trainer = make_trainer(str(output_dir), STEPS, EVERY, samples=SAMPLES, **settings)
    attach_trainer(trainer, ResiliencePlugin(persist="thread"))
    return trainer


def folders(output_dir: Path) -> list[str]:
    return sorted((p.name for p in output_dir.iterdir() if p.name.startswith("checkpoint-")), key=lambda n: int(n[11:]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, dict[int, bool]]:
    """The same run by the Trainer alone and with the pack: both output directories, the final weights' digest
    (the same for both) and what the pack's run's ``on_save`` found."""
    base = tmp_path_factory.mktemp("runs")
    stock = make_trainer(str(base / "stock"), STEPS, EVERY, samples=SAMPLES)
    stock.train()
    callback = FolderAtSave()
    pack = trainer_in(base / "pack")
    pack.add_callback(callback)
    pack.train()
    assert weights_digest(pack.model) == weights_digest(stock.model)
    return base / "stock", base / "pack", weights_digest(pack.model), callback.seen


def assert_same(ours: Any, theirs: Any, where: str) -> None:
    """Equal values, tensors and arrays included, of the same types."""
    assert type(ours) is type(theirs), where
    if isinstance(ours, torch.Tensor):
        assert torch.equal(ours, theirs), where
    elif isinstance(ours, dict):
        assert ours.keys() == theirs.keys(), where
        for key in ours:
            assert_same(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}/{i}")
    elif hasattr(ours, "tolist"):  # the numpy RNG state's array
        assert ours.dtype == theirs.dtype and ours.tolist() == theirs.tolist(), where
    else:
        assert ours == theirs, where


def test_each_save_leaves_the_folder_the_trainer_writes(runs: tuple[Path, Path, str, dict[int, bool]]) -> None:
    stock, pack, _, seen_at_save = runs
    assert folders(pack) == folders(stock) == ["checkpoint-9", "checkpoint-12", "checkpoint-14"]
    assert get_last_checkpoint(str(pack)) == str(pack / "checkpoint-14")
    assert seen_at_save == dict.fromkeys((3, 6, 9, 12, 14), True), "on_save finds the folder of a small state"
    for name in folders(pack):
        ours, theirs = pack / name, stock / name
        assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
        assert_same(load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors"), name)
        for file in PICKLED:
            with safe_globals():  # what the Trainer's own loads allow
                loaded = [torch.load(folder / file, weights_only=True) for folder in (ours, theirs)]
            assert_same(*loaded, f"{name}/{file}")
        for file in TEXT:
            assert (ours / file).read_text() == (theirs / file).read_text(), f"{name}/{file}"
        args = torch.load(ours / "training_args.bin", weights_only=False)
        assert args.save_steps == EVERY and args.output_dir == str(pack)
    assert not [p for p in pack.iterdir() if p.name.startswith(".")], "no temporary folder is left"


def test_a_trainer_without_the_pack_resumes_from_a_folder_as_the_pack_does(
    runs: tuple[Path, Path, str, dict[int, bool]], tmp_path: Path
) -> None:
    """Step 9 is inside the second epoch: weights, optimizer, schedule, RNG and batches all come back either way."""
    _, pack, digest, _ = runs
    for attached in (False, True):
        out = tmp_path / f"attached-{attached}"
        shutil.copytree(pack, out)
        trainer = trainer_in(out) if attached else make_trainer(str(out), STEPS, EVERY, samples=SAMPLES)
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-9"))
        assert trainer.state.global_step == STEPS
        assert weights_digest(trainer.model) == digest, f"attached={attached}"


def test_a_folder_the_pack_did_not_write_stops_the_run_before_it_trains(tmp_path: Path) -> None:
    out = tmp_path / "out"
    mine = out / "checkpoint-6"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    trainer = trainer_in(out)
    with pytest.raises(ConfigError, match=r"checkpoint-6 was not written by the pack.*move it out"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert os.listdir(mine) == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"


# ---- real processes ------------------------------------------------------------------------------------------


def run_worker(out: Path, log: Path, *args: str, ranks: int = 1) -> str:
    """Run the worker to its end; its final digest."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    command = [*launcher, str(WORKER), "--out", str(out), *args]
    with log.open("a") as stream:
        done = subprocess.run(command, env=base_env(), stdout=stream, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    text = log.read_text()
    assert done.returncode == 0, text[-6000:]
    return text.strip().splitlines()[-1].removeprefix("FINAL_SHA256 ")


@pytest.mark.timeout(900)
def test_two_ranks_folders_hold_each_ranks_rng_and_the_trainer_alone_resumes_from_them(tmp_path: Path) -> None:
    """3 steps an epoch on two ranks: step 8 is inside the third. A Trainer without the pack, on two ranks, resumes
    from the folder with each rank's RNG and ends with the weights of the uninterrupted run."""
    out = tmp_path / "out"
    digest = run_worker(out, tmp_path / "run.log", "--steps", "12", "--save-every", "4", ranks=2)
    assert folders(out) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    for rank in (0, 1):
        assert (out / "checkpoint-8" / f"rng_state_{rank}.pth").is_file()
    assert not (out / "checkpoint-8" / "rng_state.pth").exists()
    stock = tmp_path / "stock"
    shutil.copytree(out, stock, ignore=shutil.ignore_patterns("resilience", "goodput"))
    resumed = ("--steps", "12", "--save-every", "4", "--stock", "--resume", str(stock / "checkpoint-8"))
    assert run_worker(stock, tmp_path / "stock.log", *resumed, ranks=2) == digest


@pytest.mark.timeout(900)
def test_kill_9_while_a_folder_is_written_leaves_none_half_written_and_the_relaunch_writes_it(tmp_path: Path) -> None:
    """A state over 64 MiB: its folders are written while training goes on. The job is killed while one is being
    built; no ``checkpoint-N`` is then incomplete, and the same command writes the one that was cut short."""
    out, log = tmp_path / "out", tmp_path / "killed.log"
    settings = ("--steps", "12", "--save-every", "3", "--width", "896")
    command = [sys.executable, str(WORKER), "--out", str(out), *settings]
    with log.open("a") as stream:
        proc = subprocess.Popen(
            command, env=base_env(), stdout=stream, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        building: list[Path] = []
        while not building:
            assert proc.poll() is None, f"no folder was caught being built:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, "no folder was built in time"
            building = [p for p in out.glob(".checkpoint-*.tmp-*") if p.is_dir()] if out.is_dir() else []
            time.sleep(0.005)
    finally:
        kill_job(proc)
    cut_short = building[0].name.split(".")[1]  # .checkpoint-N.tmp-<pid>-<hex>
    for folder in out.glob("checkpoint-*"):
        assert_complete(folder)
    run_worker(out, tmp_path / "resumed.log", *settings, "--resume", "true")
    assert folders(out) == [f"checkpoint-{step}" for step in (3, 6, 9, 12)]
    assert (out / cut_short).is_dir()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "the half-built folder is removed"
    manager = CheckpointManager(CheckpointConfig(local_root=str(out / "resilience"), persist="thread"))
    try:
        for step in (3, 6, 9, 12):
            assert_complete(out / f"checkpoint-{step}")
            if step in manager.committed_steps():
                saved = manager.load(step=step, rank_state=False)
                assert saved is not None
                weights = load_file(out / f"checkpoint-{step}" / "model.safetensors")
                for name, tensor in weights.items():
                    assert torch.equal(tensor, saved.state["model"][name]), f"step {step}: {name}"
    finally:
        manager.close()


def assert_complete(folder: Path) -> None:
    """Every file of the Trainer's save is there, and the state names the folder's step."""
    for file in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", *TEXT, "training_args.bin"):
        assert (folder / file).is_file(), f"{folder.name}/{file}"
    state = json.loads((folder / "trainer_state.json").read_text())
    assert f"checkpoint-{state['global_step']}" == folder.name
