"""The CUDA paths: pinned staging from the GPU, and saves of GPU state loaded back onto the GPU.

They need a CUDA device and are skipped without one (CI has none); ``benchmarks/gpu_check.sh`` runs them first
on a GPU machine. The first GPU run (an H200, 2026-12-04) found staging buffers freed while still page-locked:
the next buffer mapped at those addresses broke the process's CUDA context, which the re-registration here
would show.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint.rng import capture_rng, restore_rng
from resilience.checkpoint.staging import PINNED, HostStager

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine (benchmarks/gpu_check.sh does)"
)


def context_is_sound() -> bool:
    """Kernels and copies still run in this process's CUDA context."""
    x = torch.randn(1024, 1024, device="cuda")
    ok = bool(torch.isfinite((x @ x).sum()).item()) and torch.equal(x.cpu().cuda(), x)
    torch.cuda.synchronize()
    return ok


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_staging_from_the_gpu_into_pinned_shared_buffers_is_exact_and_a_new_shape_registers_anew(
    asynchronous: bool,
) -> None:
    stager = HostStager(pin_memory=True, shared=True)
    sources = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(10.0, device="cuda")}
    staged = stager.stage(sources, asynchronous=asynchronous).wait()
    for key, source in sources.items():
        assert staged[key].is_pinned() and staged[key].data_ptr() in PINNED
        assert torch.equal(staged[key], source.cpu())
    old = staged["w"].data_ptr()
    sources["w"] = torch.randn(2048, 256, device="cuda")  # a new shape: the old buffer goes, a new one is locked
    staged = stager.stage(sources, asynchronous=asynchronous).wait()
    assert torch.equal(staged["w"], sources["w"].cpu()) and staged["w"].data_ptr() in PINNED
    assert old not in PINNED or old == staged["w"].data_ptr()
    del staged
    stager.close()
    assert context_is_sound()
    again = HostStager(pin_memory=True, shared=True)  # buffers mapped where the closed stager's were
    assert torch.equal(again.stage(sources, asynchronous=asynchronous).wait()["w"], sources["w"].cpu())
    again.close()
    assert context_is_sound()


def trained_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(64, 512, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("persist", ["process", "thread"])
@pytest.mark.parametrize("async_staging", [False, True], ids=["sync-staging", "async-staging"])
def test_a_gpu_state_saved_then_changed_loads_back_onto_the_gpu_as_it_was_at_the_save(
    tmp_path: Path, persist: str, async_staging: bool
) -> None:
    model, optimizer = trained_model(seed=0)
    expected = {key: value.cpu().clone() for key, value in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].cpu().clone()
    config = CheckpointConfig(tmp_path, persist=persist, async_staging=async_staging)  # type: ignore[arg-type]
    with CheckpointManager(config) as manager:
        handle = manager.save(1, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        assert handle is not None
        # the next step changes the state: with asynchronous staging the optimizer's pre-step hook first waits
        # for the copy, so the save holds the values as of the save
        model(torch.randn(64, 512, device="cuda")).square().mean().backward()
        optimizer.step()
        assert handle.committed.result(120).step == 1
    assert not torch.equal(model.state_dict()["0.weight"].cpu(), expected["0.weight"])
    fresh, fresh_optimizer = trained_model(seed=1)  # other values everywhere, moments included
    target = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
    with CheckpointManager(CheckpointConfig(tmp_path)) as manager:
        restored = manager.load(target)
    assert restored is not None and restored.step == 1
    for key, value in fresh.state_dict().items():
        assert value.is_cuda and torch.equal(value.cpu(), expected[key]), key
    fresh_optimizer.load_state_dict(restored.state["optim"])  # type: ignore[arg-type]
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"].cpu(), moments)
    assert context_is_sound()


def test_the_gpu_generators_are_captured_and_restored() -> None:
    torch.cuda.manual_seed_all(7)
    torch.randn(3, device="cuda")
    state = capture_rng()
    assert len(state["cuda"]) == torch.cuda.device_count()
    drawn = torch.randn(1000, device="cuda").cpu()
    dropout = torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5).cpu()
    torch.randn(10, device="cuda")
    restore_rng(state)
    assert torch.equal(torch.randn(1000, device="cuda").cpu(), drawn)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5).cpu(), dropout)
