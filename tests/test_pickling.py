"""What Accelerate and Lightning pickle on purpose still pickles with the pack attached: an Accelerator and its
prepared loaders (Accelerate's test_can_pickle_dataloader), and a Trainer after a fit with the pack's strategy
(Lightning's test_model_torch_save_ddp_cpu). A copy is a plain object of its framework: the handle's hooks and
threads stay with the original, which goes on working."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader, TensorDataset

from accelerate_resilience import ResiliencePlugin, attach
from tests.helpers import ROOT, WORKERS, base_env


@pytest.fixture(autouse=True)
def fresh_accelerate() -> Iterator[None]:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_an_attached_accelerator_and_its_loader_pickle_as_plain_ones(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=False))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.arange(10.0).unsqueeze(1)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with attach(accelerator, ResiliencePlugin(local_root=str(tmp_path))) as resilience:
        copied_loader = pickle.loads(pickle.dumps(loader))
        copied = pickle.loads(pickle.dumps(accelerator))
        batches = [[[2.0 * i], [2.0 * i + 1]] for i in range(5)]
        assert [batch[0].tolist() for batch in copied_loader] == batches
        assert [batch[0].tolist() for batch in copied._dataloaders[0]] == batches
        # the copies are Accelerate's own: their methods are the class's, bound to them
        assert copied.save_state.__func__ is Accelerator.save_state
        assert copied._dataloaders[0].begin.__self__ is copied._dataloaders[0]
        for (x,) in loader:  # the original is still tracked: each optimizer step counted, a save at its end
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert resilience.global_step == 5
        assert accelerator.save_state() == str(tmp_path / "step-5")
        point = resilience.resume()
        assert (point.epoch, point.batch_in_epoch) == (1, 0)  # the copies' passes did not count


def test_a_trainer_pickles_after_a_two_rank_fit_with_the_resilient_strategy(tmp_path: Path) -> None:
    command = [sys.executable, str(WORKERS / "lightning_pickle.py"), str(tmp_path)]
    done = subprocess.run(command, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert (tmp_path / "rank0.ok").exists() and (tmp_path / "rank1.ok").exists()
