"""One rank of a real gloo job with an HSDP model (``fully_shard`` over a 2-D CPU mesh: replicated along the first
dimension, sharded along the second), checkpointed through the engine; launched by tests/test_engine_hsdp.py.

Usage: hsdp_engine.py save|load ROOT. ``save`` (4 ranks, mesh 2 x 2) trains two steps, prints each rank's share
of the state (what it stages and writes) and the replica sets of its chunks, saves, and writes the full state
from rank 0. ``load`` restores into a fresh model, HSDP again on 4 ranks or plain FSDP2 on 2 (resharding), and
compares the full state with the saved one, tensor for tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from resilience import CheckpointConfig, CheckpointManager
from resilience.survivors import holders, share_among
from resilience.tree import flatten
from tests.workers.reliability_reshard import assert_same, full_state, restore, sharded_state, train_step


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """HSDP on 4 ranks (2 replicas of 2 shards), FSDP2 over all ranks otherwise."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 8))
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    with CheckpointManager(CheckpointConfig(root, keep_last=2)) as manager:
        if mode == "save":
            for step in range(2):
                train_step(model, opt, step)
            state = sharded_state("fsdp2", model, opt)
            tensors = flatten(state).tensors
            weight = next(t for t in tensors.values() if isinstance(t, DTensor))
            mine = share_among(tensors, rank, list(range(world)))
            held = sum(t.to_local().numel() * t.element_size() for t in tensors.values() if isinstance(t, DTensor))
            staged = sum(t.to_local().numel() * t.element_size() for t in mine.values() if isinstance(t, DTensor))
            print(f"REPLICAS {rank} {holders(weight)}", flush=True)
            print(f"SHARE {rank} {staged} {held}", flush=True)
            manager.save(2, state)
            manager.wait()
            reference = full_state("fsdp2", model, opt)
            if rank == 0:
                torch.save(reference, root / "reference.pt")
        else:
            restored = manager.load(sharded_state("fsdp2", model, opt))
            assert restored is not None and restored.step == 2, restored
            restore("fsdp2", model, opt, restored.state)
            loaded = full_state("fsdp2", model, opt)
            if rank == 0:
                assert_same(loaded, torch.load(root / "reference.pt", weights_only=True))
            print("LOADED", restored.manifest.world_size, "->", world, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
