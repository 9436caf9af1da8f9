"""The Accelerate handle in one process: automatic and asynchronous saves, the resume point at and inside an epoch,
Accelerate's routed methods, defaults from ProjectConfiguration, and what reaches a tracker.

Two-rank jobs through ``accelerate launch`` are in test_accelerate_launch.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState
from accelerate.tracking import GeneralTracker
from accelerate.utils import ProjectConfiguration

from accelerate_resilience import ResiliencePlugin, attach
from resilience.errors import CheckpointError, ConfigError
from tests.workers.accelerate_train import Job, build_job, final_state, train


class ListTracker(GeneralTracker):
    name = "list"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict[str, Any]] = []

    @property
    def tracker(self) -> list[dict[str, Any]]:
        return self.logged

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append({"step": step, **values})


def _reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("ACCELERATE_RESILIENCE_"):
            monkeypatch.delenv(name)
    yield
    _reset_accelerate()


def new_job(*, stateful: bool = True, project: ProjectConfiguration | None = None, tracker: Any = None) -> Job:
    _reset_accelerate()
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful, use_seedable_sampler=True),
        project_config=project,
        log_with=[tracker] if tracker is not None else None,
    )
    if tracker is not None:
        accelerator.init_trackers("test")
    return build_job(accelerator)


def assert_same_training(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["indices"] == want["indices"], "the data order differs"
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for index, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["optimizer"]["state"][index][name], value), (index, name)
    assert got["scheduler"] == want["scheduler"]


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in root.glob("step-*/manifest.json"))


def test_interval_async_saves_resume_exactly_at_an_epoch_boundary(tmp_path: Path) -> None:
    # 40 samples, batch 4, one process: 10 steps per epoch, 3 epochs.
    tracker = ListTracker()
    job = new_job(tracker=tracker)
    plugin = ResiliencePlugin(local_root=str(tmp_path), every_n_steps=5, keep_every=10, async_staging=True)
    with attach(job.accelerator, plugin) as resilience:
        point = resilience.resume()
        assert not point.restored
        train(job, resilience, point)
        assert resilience.save() is not None  # the last step: no next batch drew an automatic save
        want = final_state(job)
    assert committed_steps(tmp_path) == [10, 20, 25, 30]  # keep_last=3 plus the multiples of keep_every
    commits = [entry for entry in tracker.logged if "checkpoint/write_s" in entry]  # local commits
    assert [entry["checkpoint/committed_step"] for entry in commits] == [5, 10, 15, 20, 25, 30]
    assert all(entry["checkpoint/block_s"] < 5 for entry in commits)

    # Step 10 ended epoch 0; its automatic save ran as epoch 1's first batch was drawn.
    job = new_job()
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path), async_staging=True)) as resilience:
        point = resilience.resume(step=10)
        assert (point.epoch, point.batch_in_epoch, point.global_step, point.batches_to_skip) == (1, 0, 10, 0)
        train(job, resilience, point)
        assert resilience.global_step == 30
        assert_same_training(final_state(job), want)

    job = new_job()
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path))) as resilience:
        point = resilience.resume()
        assert (point.epoch, point.batch_in_epoch, point.global_step) == (3, 0, 30)
        assert job.loader.iteration == 3


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "plain"])
@pytest.mark.parametrize(
    ("stop_at", "epoch", "batch"),
    [(13, 1, 3), (10, 1, 0)],
    ids=["mid-epoch", "after-the-last-batch-of-epoch-0"],
)
def test_stop_and_resume_is_exact(tmp_path: Path, stateful: bool, stop_at: int, epoch: int, batch: int) -> None:
    job = new_job(stateful=stateful)
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path / "reference"))) as resilience:
        train(job, resilience, resilience.resume())
        want = final_state(job)

    job = new_job(stateful=stateful)
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path / "run"))) as resilience:
        train(job, resilience, resilience.resume(), stop_at=stop_at)
    job = new_job(stateful=stateful)
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path / "run"))) as resilience:
        point = resilience.resume()
        assert (point.epoch, point.batch_in_epoch, point.global_step) == (epoch, batch, stop_at)
        assert point.batches_to_skip == (0 if stateful else batch)
        if stateful and batch:
            with pytest.raises(CheckpointError, match=f"already continues at batch {batch} of epoch {epoch}"):
                job.accelerator.skip_first_batches(job.loader, batch)
        train(job, resilience, point)
        assert_same_training(final_state(job), want)


def test_routed_methods_and_their_limits(tmp_path: Path) -> None:
    job = new_job()
    accelerator = job.accelerator
    resilience = attach(accelerator, ResiliencePlugin(local_root=str(tmp_path / "ck")))
    with pytest.raises(ConfigError, match="already has a ResilienceHandle"):
        attach(accelerator, ResiliencePlugin(local_root=str(tmp_path / "other")))
    with pytest.raises(ConfigError, match="the framework would write this URL as a local folder"):
        accelerator.save_state("s3://bucket/run")
    with pytest.raises(ConfigError, match=r"load_state\('s3://bucket/run'\): .* not this run's durable_url \(None\)"):
        accelerator.load_state("s3://bucket/run/")
    train(job, resilience, resilience.resume(), stop_at=3)  # saves through accelerator.save_state()
    # the same optimizer step again: a checkpoint of its own, numbered past the last, in the folder Accelerate
    # would return as its output dir
    assert accelerator.save_state(str(tmp_path / "ck")) == str(tmp_path / "ck" / "step-4")
    accelerator.save_state(tmp_path / "export")  # another folder: Accelerate's own synchronous export
    assert (tmp_path / "export" / "model.safetensors").exists()
    resilience.close()
    assert committed_steps(tmp_path / "ck") == [3, 4]
    assert "save_state" not in vars(accelerator) and "end_training" not in vars(accelerator)
    assert "_update_state_dict" not in vars(job.loader)


def test_project_configuration_gives_defaults_and_numbering_survives_restarts(tmp_path: Path) -> None:
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    for stop_at in (4, 7):  # a restarted run saving with save_state() again: no "already exists" (#1601, #3306)
        job = new_job(project=project)
        resilience = attach(job.accelerator)
        assert resilience.manager.config.local_root == str(tmp_path / "resilience")
        assert resilience.manager.config.keep_last == 2  # total_limit=1 would leave nothing during a save
        point = job.accelerator.load_state()
        assert point.global_step == (0 if stop_at == 4 else 4)
        train(job, resilience, point, stop_at=stop_at)
        job.accelerator.end_training()
    assert committed_steps(tmp_path / "resilience") == [4, 7]


def test_resume_into_a_different_job_says_what_differs(tmp_path: Path) -> None:
    job = new_job()
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path))) as resilience:
        train(job, resilience, resilience.resume(), stop_at=2)
    job = new_job()
    job.accelerator.register_for_checkpointing(torch.optim.SGD([torch.zeros(1)], lr=0.1))
    with (
        attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path))) as resilience,
        pytest.raises(CheckpointError, match="holds 1 objects registered for checkpointing but this run registered 2"),
    ):
        resilience.resume()


def test_a_small_model_in_one_process_persists_in_threads_by_default(tmp_path: Path) -> None:
    """Its helper process would cost every run an interpreter importing torch, which the first commit waits for."""
    job = new_job()
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path))) as resilience:
        assert resilience.manager.config.persist == "thread"
        train(job, resilience, resilience.resume(), stop_at=2)
    assert committed_steps(tmp_path) == [2]


def test_load_state_right_after_save_state_restores_what_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollback: save_state(), change the model, load_state() at once. The save is still being written (each
    write in the helper process waits 1.5 s first), so the load must wait for its commit, not find nothing."""
    monkeypatch.setenv("RESILIENCE_HELPER_PRELOAD", "tests.workers.helper_faults")
    monkeypatch.setenv("TEST_HELPER_FAULT", "slow_write")
    monkeypatch.setenv("TEST_SLOW_WRITE_S", "1.5")
    job = new_job()
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path), persist="process")) as resilience:
        train(job, resilience, resilience.resume(), stop_at=2)  # ends with accelerator.save_state()
        saved = final_state(job)
        assert committed_steps(tmp_path) == [], "the save must still be in flight for this test to mean anything"
        with torch.no_grad():
            for parameter in job.model.parameters():
                parameter.add_(1.0)
        point = job.accelerator.load_state()
        assert point.restored and point.global_step == 2
        assert committed_steps(tmp_path) == [2]
        restored = final_state(job)
    for name, tensor in saved["model"].items():
        assert torch.equal(restored["model"][name], tensor), name


def test_a_fault_drill_without_health_says_so_instead_of_doing_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM drill that ran to the end with exit 0 made a user believe preemption handling worked."""
    monkeypatch.setenv("RESILIENCE_INJECT", "signal=SIGTERM@step=2")
    job = new_job()
    resilience = attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path), persist="thread"))
    with pytest.raises(ConfigError, match=r"RESILIENCE_INJECT=.* this run does not watch health.*HEALTH=1"):
        resilience.save()
    resilience.close()
