"""Rolling back in the same process with ``accelerator.load_state()``, as Accelerate's own tests and users do: the
optimizer gets what the checkpoint holds, even fewer entries than it has now (saved before its first step, or
while part of the model was frozen), as ``optimizer.load_state_dict`` takes them; the model stays strict."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from accelerate_resilience import ResiliencePlugin, attach
from accelerate_resilience.handle import ResilienceHandle


@pytest.fixture(autouse=True)
def fresh_accelerate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in [n for n in os.environ if n.startswith("ACCELERATE_RESILIENCE_")]:
        monkeypatch.delenv(name)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def prepared(root: Path) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, ResilienceHandle]:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=0.1))
    return accelerator, model, optimizer, attach(accelerator, ResiliencePlugin(local_root=str(root)))


def train(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_checkpoint_saved_before_the_first_optimizer_step_loads_back(tmp_path: Path) -> None:
    accelerator, model, optimizer, handle = prepared(tmp_path)
    before = weights(model)
    path = accelerator.save_state()
    train(accelerator, model, optimizer, 3)
    assert optimizer.state_dict()["state"]  # Adam has exp_avg and exp_avg_sq now
    accelerator.load_state(path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {}  # as saved: no step taken yet
    train(accelerator, model, optimizer, 1)  # and training goes on from there
    handle.close()


def test_a_checkpoint_saved_with_part_of_the_model_frozen_loads_back(tmp_path: Path) -> None:
    accelerator, model, optimizer, handle = prepared(tmp_path)
    for parameter in model[0].parameters():  # type: ignore[index]
        parameter.requires_grad_(False)
    train(accelerator, model, optimizer, 2)
    saved_state = copy.deepcopy(optimizer.state_dict()["state"])
    assert len(saved_state) == 2  # the second layer's weight and bias only
    saved = weights(model)
    path = accelerator.save_state()
    for parameter in model[0].parameters():  # type: ignore[index]
        parameter.requires_grad_(True)
    train(accelerator, model, optimizer, 2)
    assert len(optimizer.state_dict()["state"]) == 4
    accelerator.load_state(path)
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    state = optimizer.state_dict()["state"]
    assert sorted(state) == sorted(saved_state)
    assert all(torch.equal(state[i][n], v) for i, entry in saved_state.items() for n, v in entry.items() if n != "step")
    handle.close()


def test_the_model_stays_as_strict_as_stock(tmp_path: Path) -> None:
    """A model with a parameter the checkpoint lacks is refused, as ``load_state_dict`` refuses it."""
    accelerator, model, _, handle = prepared(tmp_path)
    path = accelerator.save_state()
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(Exception, match="extra"):
        accelerator.load_state(path)
    handle.close()
