"""Resilient training with Lightning Fabric: asynchronous checkpoints, exact resume, a clean stop on preemption.
The additions to a plain Fabric script are marked ``# resilience``.

Two CPU processes, started by ``fabric.launch()``:

    python examples/fabric_train.py --ckpt /tmp/fabric-ckpt --steps 60

Stop it any way you like (Ctrl-C, ``kill -9``, ``kill -TERM``) and run the same command again: it continues from the
newest committed checkpoint, and ends with the weights an uninterrupted run ends with. Its last line is
``FINAL_SHA256 <digest of the trained weights>``. ``resilience report /tmp/fabric-ckpt`` shows where the wall time
of every run went.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_resilience.fabric import GoodputMonitor, HealthGuardCallback, ResilientCheckpointIO, resume

SAMPLES, BATCH = 1024, 16


@functools.cache
def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(7)
    features = torch.randn(SAMPLES, 32, generator=data)
    return features, features @ torch.randn(32, 1, generator=data)


def batch_at(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` on ``rank``. Each epoch's order comes from a generator seeded with the epoch, so the
    step in the checkpoint is the data position: a resumed run draws the batch an uninterrupted run would."""
    epoch, index = divmod(step, SAMPLES // world // BATCH)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + epoch))[rank::world]
    rows = order[index * BATCH : (index + 1) * BATCH]
    features, targets = dataset()
    return features[rows], targets[rows]


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    parser.add_argument("--save-every", type=int, default=5, help="fabric.save every N steps")
    parser.add_argument("--durable-url", default=None, help="fsspec URL checkpoints are uploaded to, e.g. s3://b/run")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to watch it being stopped")
    args = parser.parse_args()

    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy="resilient_ddp",  # resilience: every rank writes its share of fabric.save
        plugins=[ResilientCheckpointIO(args.ckpt, durable_url=args.durable_url)],  # resilience
        callbacks=[HealthGuardCallback(), GoodputMonitor()],  # resilience: preemption and GPU faults; goodput
    )
    fabric.launch()
    fabric.seed_everything(42 + fabric.global_rank)  # DDP gives every rank rank 0's weights; dropout differs
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    resume(fabric, state)  # resilience: the newest committed checkpoint, with each rank's RNG; nothing: as it is
    if state["step"]:
        fabric.print(f"resumed at step {state['step']}")

    while state["step"] < args.steps:
        features, targets = batch_at(state["step"], fabric.global_rank, fabric.world_size)
        fabric.call("on_train_batch_start")  # resilience (optional): data-wait figures
        loss = F.mse_loss(model(features), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        fabric.call("on_train_batch_end")  # resilience: the step boundary, where a preemption is saved
        if state["step"] % args.save_every == 0:
            fabric.save(os.path.join(args.ckpt, "last.ckpt"), state)  # asynchronous, committed, verified at load
        time.sleep(args.step_sleep)

    fabric.call("on_train_end")  # resilience: waits for the last saves; the ledger ends as completed
    fabric.barrier()
    if fabric.global_rank == 0:
        print(f"FINAL_SHA256 {weights_digest(model)}", flush=True)


if __name__ == "__main__":
    main()
