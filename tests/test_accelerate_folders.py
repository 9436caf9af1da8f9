"""Accelerate's automatic checkpoint naming with the pack attached: each ``save_state()`` leaves
``<project_dir>/checkpoints/checkpoint_<i>``, the folder Accelerate's own save writes, which stock
``load_state(path)`` reads without the pack; ``total_limit`` of them are kept; ``load_state(folder)`` with the pack
takes the folder's step from the engine, and ``save_iteration`` counts as Accelerate counts."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration

from accelerate_resilience import attach
from resilience.errors import ConfigError
from tests.helpers import WORKERS, accelerate_launch, base_env
from tests.test_accelerate_handle import (
    assert_same_training,
    fresh_accelerate,  # noqa: F401  (autouse: each test's own Accelerate)
)
from tests.workers.accelerate_train import Job, build_job, final_state, train


def job_in(project_dir: Path, *, total_limit: int | None = 2, iteration: int = 0) -> Job:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    project = ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True, total_limit=total_limit, iteration=iteration
    )
    loaders = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
    return build_job(Accelerator(cpu=True, project_config=project, dataloader_config=loaders))


def one_step(job: Job) -> None:
    _, x, y = next(iter(job.loader))
    job.accelerator.backward(F.mse_loss(job.model(x), y))
    job.optimizer.step()
    job.scheduler.step()
    job.optimizer.zero_grad()


def folders(project_dir: Path) -> list[str]:
    return sorted(os.listdir(project_dir / "checkpoints"), key=lambda name: int(name.rsplit("_", 1)[1]))


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "pickle"])
def test_each_save_state_leaves_a_folder_stock_accelerate_loads(tmp_path: Path, safetensors: bool) -> None:
    job = job_in(tmp_path)
    accelerator = job.accelerator
    with attach(accelerator) as resilience:
        train(job, resilience, resilience.resume(), stop_at=3)  # save_state() at step 3: checkpoint_0
        one_step(job)
        saved = [accelerator.save_state(safe_serialization=safetensors) for _ in range(2)]
        assert saved == [str(tmp_path / "checkpoints" / f"checkpoint_{i}") for i in (1, 2)]
        assert folders(tmp_path) == ["checkpoint_1", "checkpoint_2"]  # total_limit=2, on return
        want = final_state(job)
    weights = "model.safetensors" if safetensors else "pytorch_model.bin"
    assert {weights, "optimizer.bin", "scheduler.bin", "dl_state_dict.bin", "random_states_0.pkl"} <= set(
        os.listdir(saved[-1])
    )

    AcceleratorState._reset_state(True)  # Accelerate alone, as a user or tool without the pack reads the folder
    GradientState._reset_state()
    loaders = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
    stock = build_job(Accelerator(cpu=True, dataloader_config=loaders))
    stock.accelerator.load_state(saved[-1])
    assert_same_training(final_state(stock), want)


def test_load_state_of_a_folder_takes_its_step_and_numbering_goes_on_as_accelerate_counts(tmp_path: Path) -> None:
    job = job_in(tmp_path, total_limit=None)
    accelerator = job.accelerator
    with attach(accelerator) as resilience:
        train(job, resilience, resilience.resume(), stop_at=2)  # checkpoint_0, at step 2
        at_2 = copy.deepcopy(final_state(job))  # the live tensors change with the next step
        one_step(job)
        accelerator.save_state()  # checkpoint_1, at step 3
        point = accelerator.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))
        assert point.restored and point.global_step == 2
        assert_same_training(final_state(job), at_2)
        assert accelerator.save_iteration == 2  # Accelerate's load_state leaves the count alone
        assert accelerator.save_state() == str(tmp_path / "checkpoints" / "checkpoint_2")

    job = job_in(tmp_path, total_limit=None)  # a restarted run: resumes the newest and counts on
    with attach(job.accelerator):
        assert job.accelerator.load_state().global_step == 2
        assert job.accelerator.save_iteration == 3
        assert job.accelerator.save_state() == str(tmp_path / "checkpoints" / "checkpoint_3")
    assert folders(tmp_path) == [f"checkpoint_{i}" for i in range(4)]


def test_a_run_that_would_name_an_existing_folder_is_refused_before_it_saves(tmp_path: Path) -> None:
    job = job_in(tmp_path)
    with attach(job.accelerator) as resilience:
        train(job, resilience, resilience.resume(), stop_at=2)
    job = job_in(tmp_path)  # starts afresh, without load_state(): its first save would be checkpoint_0 again
    with attach(job.accelerator), pytest.raises(ConfigError, match=r"checkpoint_0 already exists.*load_state\(\)"):
        job.accelerator.save_state()
    assert folders(tmp_path) == ["checkpoint_0"]
    assert (
        torch.load(tmp_path / "checkpoints" / "checkpoint_0" / "random_states_0.pkl", weights_only=False)["step"] == 0
    )


def test_two_ranks_name_one_folder_with_both_ranks_rng_and_load_it_back_together(tmp_path: Path) -> None:
    env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    command = accelerate_launch(WORKERS / "accelerate_folders.py", str(tmp_path))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    reports = {
        int(line.split()[1].removeprefix("rank=")): json.loads(line.split(" ", 2)[2])
        for line in done.stdout.splitlines()
        if line.startswith("FOLDERS")
    }
    first, second = (str(tmp_path / "checkpoints" / f"checkpoint_{i}") for i in (0, 1))
    for report in reports.values():
        assert (report["saved"], report["step"], report["iteration"]) == ([first, second], 2, 2)
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= set(
        os.listdir(second)
    )
    for rank in (0, 1):  # every rank's own stream, though rank 0 wrote the folder
        states = torch.load(Path(second) / f"random_states_{rank}.pkl", weights_only=False)
        assert int(states["torch_manual_seed"].sum()) == reports[rank]["rng"]
    assert reports[0]["rng"] != reports[1]["rng"]
