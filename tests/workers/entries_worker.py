"""One rank of a gloo job saving and loading many small tensors; launched by tests/test_entries.py.

Usage: entries_worker.py SCENARIO ROOT. ``save`` (any number of ranks): step 1 of a state of many small plain
tensors (dealt out to every rank) and a DTensor, then a save whose plain tensors differ in shape between the
ranks, which must fail on every rank. ``load``: loads step 1 without a target and into a target, whose small
tensors are DTensors sharded over the ranks now (saved plain, as DDP would, loaded as FSDP would).
``load-packed``: the same for step 7 of tests/data/packed-step-7, its small tensors packed by an earlier release.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from resilience import CheckpointConfig, CheckpointError, CheckpointManager

SMALL = 40


def expected() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    values = {f"p{i}": torch.randn(4, i % 5 + 2, generator=gen) for i in range(SMALL)}
    values["flags"] = torch.rand(6, generator=gen) > 0.5
    values["half"] = torch.randn(3, 2, generator=gen).to(torch.bfloat16)
    values["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    values["sharded"] = torch.randn(8, 4, generator=gen)
    return values


def packed() -> dict[str, torch.Tensor]:
    """The tensors of tests/data/packed-step-7 (made so by an earlier release)."""
    gen = torch.Generator().manual_seed(0)
    values = {"a.weight": torch.randn(4, 3, generator=gen), "a.bias": torch.randn(4, generator=gen)}
    values["b.weight"] = torch.randn(100, generator=gen).to(torch.bfloat16)
    return values


def config(root: str) -> CheckpointConfig:
    return CheckpointConfig(root, keep_last=2)


def main() -> None:
    scenario, root = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    values = packed() if scenario == "load-packed" else expected()
    step = 7 if scenario == "load-packed" else 1

    def dtensor(value: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(value, mesh, [Shard(0)]) if mesh is not None else value

    if scenario == "save":
        state = {"model": {k: v for k, v in values.items() if k != "sharded"}, "sharded": dtensor(values["sharded"])}
        with CheckpointManager(config(root)) as manager:
            manager.save(1, state)
            manager.wait()
            state["model"]["p0"] = torch.zeros(4, 2 + rank)  # a shape that differs between the ranks
            try:
                manager.save(2, state)
            except CheckpointError as exc:
                print("REFUSED", exc)
        print("SAVED", world)

    elif scenario in ("load", "load-packed"):
        with CheckpointManager(config(root)) as manager:
            restored = manager.load(step=step)
            assert restored is not None
            for key, value in values.items():
                got = restored.state["sharded"] if key == "sharded" else restored.state["model"][key]
                assert got.dtype == value.dtype and torch.equal(got, value), key
            # into a target: the small tensors now sharded DTensors (where they divide), the rest plain
            target = {
                "model": {
                    k: dtensor(torch.zeros_like(v)) if v.dim() and v.shape[0] % world == 0 else torch.zeros_like(v)
                    for k, v in values.items()
                    if k != "sharded"
                },
            }
            if "sharded" in values:
                target["sharded"] = dtensor(torch.zeros(8, 4))
            restored = manager.load(target, step=step)
            assert restored is not None
            for key, value in values.items():
                got = restored.state["sharded"] if key == "sharded" else restored.state["model"][key]
                want = target["sharded"] if key == "sharded" else target["model"][key]
                assert got is want, f"{key} was not filled in place"
                full = got.full_tensor() if isinstance(got, DTensor) else got
                assert full.dtype == value.dtype and torch.equal(full, value), key
        print("LOADED", world)

    else:
        raise SystemExit(f"unknown scenario {scenario}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
