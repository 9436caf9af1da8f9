"""Every ``accelerator.save_state()`` keeps the state as it is at the call, in a checkpoint of its own.

Accelerate counts saves, not optimizer steps: a job that prepares no optimizer, or saves several times between two
optimizer steps (at an epoch's end and again explicitly), must still get each state back, and ``load_state()``
the newest, in the same process and in a new one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from accelerate_resilience import ResiliencePlugin, attach
from resilience.errors import CheckpointExistsError
from tests.helpers import WORKERS, base_env
from tests.test_accelerate_handle import (
    committed_steps,
    fresh_accelerate,  # noqa: F401  (autouse: each test's own Accelerate)
    new_job,
)
from tests.workers import accelerate_model_only
from tests.workers.accelerate_train import train


def assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_saves_with_no_prepared_optimizer_each_keep_their_state(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    accelerator, model = accelerate_model_only.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # stepped here, never prepared: no step is counted
    data = torch.Generator().manual_seed(0)
    states, paths = [], []
    with attach(accelerator, ResiliencePlugin(local_root=str(root), keep_last=10)) as resilience:
        for _ in range(4):
            for _ in range(3):
                loss = F.mse_loss(model(torch.randn(8, 4, generator=data)), torch.randn(8, 2, generator=data))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            paths.append(accelerator.save_state())
            states.append(accelerate_model_only.weights(model))
        assert paths == [str(root / f"step-{n}") for n in range(4)]
        assert resilience.global_step == 0
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
        point = accelerator.load_state()
        assert point.restored and point.path == paths[-1]
        assert_weights(accelerate_model_only.weights(model), states[-1])
        for number, state in enumerate(states):  # each checkpoint holds the state at its call
            resilience.resume(step=number)
            assert_weights(accelerate_model_only.weights(model), state)
    assert committed_steps(root) == [0, 1, 2, 3]

    out = tmp_path / "new-process.pt"
    worker = [sys.executable, str(WORKERS / "accelerate_model_only.py"), str(root), str(out)]
    run = subprocess.run(worker, env=base_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    got = torch.load(out)
    assert got["resume"]["restored"] and got["resume"]["path"] == paths[-1]
    assert_weights(got["weights"], states[-1])
    assert got["saved_to"] == str(root / "step-4")  # a restarted run numbers on past the newest
    assert committed_steps(root) == [0, 1, 2, 3, 4]


def test_eleven_saves_between_two_optimizer_steps_are_eleven_checkpoints(tmp_path: Path) -> None:
    job = new_job()
    accelerator = job.accelerator
    weights = []
    with attach(accelerator, ResiliencePlugin(local_root=str(tmp_path), keep_last=20)) as resilience:
        train(job, resilience, resilience.resume(), stop_at=2)  # its save_state() at step 2
        paths = []
        for index in range(11):
            job.seen.indices.append(1000 + index)  # registered for checkpointing: per-rank state
            with torch.no_grad():
                next(job.model.parameters()).add_(1.0)  # shared state
            paths.append(accelerator.save_state())
            weights.append(next(job.model.parameters()).detach().clone())
        assert paths == [str(tmp_path / f"step-{n}") for n in range(3, 14)]
        assert resilience.global_step == 2
        _, x, y = next(iter(job.loader))  # one more optimizer step: numbered past the eleven saves
        accelerator.backward(F.mse_loss(job.model(x), y))
        job.optimizer.step()
        assert accelerator.save_state() == str(tmp_path / "step-14")
    assert committed_steps(tmp_path) == list(range(2, 15))

    job = new_job()
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path))) as resilience:
        for index, number in enumerate(range(3, 14)):
            point = resilience.resume(step=number)
            assert point.global_step == 2
            assert job.seen.indices[-1] == 1000 + index
            assert torch.equal(next(job.model.parameters()), weights[index])


def test_state_changed_as_save_state_returns_is_not_in_its_checkpoint(tmp_path: Path) -> None:
    """An EMA swapped in for an evaluation, parameters edited by hand: right after ``save_state()`` returns, with
    the default background copy and no optimizer step between. 32 MB of state, so that a copy still reading the
    live tensors would take in the change (it did, before ``save_state()`` waited for the copy)."""
    from accelerate import Accelerator
    from torch import nn

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8))))
    with attach(accelerator, ResiliencePlugin(local_root=str(tmp_path), persist="thread")):
        at_the_call = accelerate_model_only.weights(model)
        path = accelerator.save_state()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        accelerator.load_state(path)
        assert_weights(accelerate_model_only.weights(model), at_the_call)


def test_a_number_given_twice_is_refused_at_the_call(tmp_path: Path) -> None:
    job = new_job()
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path))) as resilience:
        assert resilience.save(step=5) is not None
        with pytest.raises(CheckpointExistsError, match=r"save\(step=5\): .* Leave step out"):
            resilience.save(step=5)
        assert job.accelerator.save_state() == str(tmp_path / "step-6")  # above the caller's number
    assert committed_steps(tmp_path) == [5, 6]
