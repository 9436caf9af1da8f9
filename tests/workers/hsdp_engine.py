"""One rank of a real gloo job with an HSDP model (``fully_shard`` over a 2-D CPU mesh: replicated along the first
dimension, sharded along the second), checkpointed through the engine; launched by tests/test_engine_hsdp.py.

Usage: hsdp_engine.py save|load|train|kill|resume ROOT. ``save`` (4 ranks, mesh 2 x 2) trains two steps, prints
each rank's share of the state (what it stages and writes) and the replica sets of its chunks, saves, and writes
the full state from rank 0. ``load`` restores into a fresh model, HSDP again on 4 ranks or plain FSDP2 on 2
(resharding), and compares the full state with the saved one, tensor for tensor.

``train``, ``kill`` and ``resume`` run the engine's training session (interval saves every 4 steps, survivor saves
on) for 12 steps and write the full final state to ROOT/final.pt: ``kill`` has rank 1 SIGKILL itself as step 7
begins, so the others, in FSDP's collectives, must save step 6 among themselves (rank 1's chunks from its replica,
rank 3) and exit 75; ``resume`` loads the newest checkpoint and trains on.
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
from resilience.checkpoint.deal import holders, share_among
from resilience.checkpoint.rng import capture_rng
from resilience.checkpoint.tree import flatten
from resilience.goodput import IntervalConfig
from resilience.recovery.peer_loss import PeerLossConfig
from resilience.session import SaveState, TrainingSession
from tests.workers.reliability_reshard import assert_same, full_state, restore, sharded_state, train_step
from tests.workers.victim import die_after_boundary


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


STEPS = 12


def session_run(mode: str, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    """Training through the engine's session, as an adapter drives it; a lost peer shows in FSDP's collectives."""

    def state(step: int) -> SaveState:
        return SaveState(sharded_state("fsdp2", model, opt), {"rng": capture_rng()}, {"step": step})

    manager = CheckpointManager(CheckpointConfig(root / "ckpt", keep_last=3, collective_timeout_s=60))
    session = TrainingSession(manager, state)
    session.use_interval(IntervalConfig(every_n_steps=4))
    session.use_peer_loss(PeerLossConfig(stale_s=3.0, heartbeat_s=0.5, grace_s=60))
    step = 0
    if mode == "resume":
        restored = session.restore(lambda: sharded_state("fsdp2", model, opt))
        assert restored is not None
        restore("fsdp2", model, opt, restored.state)
        step = restored.step
        session.restored(restored)
        print("RESUMED", step, restored.manifest.extra.get("survivor_save"), flush=True)
    session.start(step)
    try:
        while step < STEPS:
            session.step_begin(step)
            if mode == "kill" and step == 6 and rank == 1:
                die_after_boundary(session, step)
            train_step(model, opt, step)
            step += 1
            if session.step_end(step).saved is not None:
                session.wait()
    except RuntimeError as exc:
        session.on_failure(exc)  # a lost peer: the survivors save among themselves and exit 75
        raise
    session.end()
    final = full_state("fsdp2", model, opt)
    if rank == 0:
        torch.save(final, root / "final.pt")


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    if mode in ("train", "kill", "resume"):
        session_run(mode, root, model, opt, rank)
        dist.barrier()
        dist.destroy_process_group()
        return
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
