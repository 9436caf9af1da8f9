"""One rank of a real gloo job that trains DDP and FSDP2 models, checkpoints them through the engine, and
resumes them on another number of ranks; launched by tests/test_reliability_reshard.py.

Usage: reliability_reshard.py save|load ROOT. ``save`` trains three steps and writes, from rank 0, the full
(unsharded) model and optimizer state next to the checkpoint; ``load`` restores into freshly built models
and compares their full state with that reference, tensor for tensor, then takes one more step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from resilience import CheckpointConfig, CheckpointManager

STEP = 3
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(kind: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    if kind == "ddp":
        model = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def sharded_state(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a training loop hands the engine: plain replicated tensors (DDP) or DTensor shards (FSDP2)."""
    if kind == "ddp":
        assert isinstance(model, DistributedDataParallel)
        return {"model": model.module.state_dict(), "optim": opt.state_dict()}
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def restore(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    if kind == "ddp":
        assert isinstance(model, DistributedDataParallel)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    else:  # model and optimizer separately: together, non-zero ranks hang (see notes/dcp.md)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])


def full_state(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    if kind == "ddp":
        assert isinstance(model, DistributedDataParallel)
        return {"model": model.module.state_dict(), "optim": opt.state_dict()}
    return {
        "model": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, opt, options=FULL),
    }


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got.cpu(), want), f"{path} differs"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}/{i}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")  # also with one rank: FSDP2 needs a device mesh
    rank, world = dist.get_rank(), dist.get_world_size()
    for kind in ("ddp", "fsdp2"):
        model, opt = build(kind, seed=0 if mode == "save" else 1234)
        with CheckpointManager(CheckpointConfig(root / kind, keep_last=2)) as manager:
            if mode == "save":
                for step in range(STEP):
                    train_step(model, opt, step)
                manager.save(STEP, sharded_state(kind, model, opt))
                manager.wait()
                reference = full_state(kind, model, opt)
                if rank == 0:
                    torch.save(reference, root / f"{kind}-reference.pt")
                print("SAVED", kind, world, flush=True)
            else:
                restored = manager.load(sharded_state(kind, model, opt))
                assert restored is not None and restored.step == STEP, restored
                restore(kind, model, opt, restored.state)
                loaded = full_state(kind, model, opt)
                if rank == 0:
                    assert_same(loaded, torch.load(root / f"{kind}-reference.pt", weights_only=True))
                train_step(model, opt, STEP)  # and training goes on from there
                print("LOADED", kind, restored.manifest.world_size, "->", world, flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
