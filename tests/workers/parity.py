"""One scenario, either framework: 12 optimizer steps of the same small model, an interval save every 4 steps,
the goodput ledger, and the health guard (a drill stops the run where ``RESILIENCE_INJECT`` says).

Usage: parity.py lightning|accelerate ROOT. Checkpoints go to ROOT/ckpt, the ledger to ROOT (the run dir).
Prints ``FINISHED <global step>`` at the end of a completed run.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 12
EVERY = 4


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(48, 8, generator=gen), torch.randn(48, 1, generator=gen))


def lightning(root: str) -> None:
    import lightning.pytorch as pl

    from lightning_resilience import (
        AutoResume,
        GoodputMonitor,
        HealthGuardCallback,
        PeriodicCheckpoint,
        ResilientCheckpointIO,
    )

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        plugins=[ResilientCheckpointIO(f"{root}/ckpt")],
        callbacks=[
            AutoResume(),
            GoodputMonitor(run_dir=root, span_s=0),
            HealthGuardCallback(nvml=False, grace_s=30),
            PeriodicCheckpoint(every_n_steps=EVERY),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(Model(), DataLoader(data(), batch_size=4))
    print(f"FINISHED {trainer.global_step}", flush=True)  # one write: ranks share stdout


def accelerate(root: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from accelerate_resilience import ResiliencePlugin, attach

    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data(), batch_size=4))
    plugin = ResiliencePlugin(
        local_root=f"{root}/ckpt", run_dir=root, every_n_steps=EVERY, health=True, goodput_span_s=0, grace_s=30
    )
    resilience = attach(accelerator, plugin)
    point = resilience.resume()
    for x, y in accelerator.skip_first_batches(loader, point.batches_to_skip):
        if resilience.should_stop() or resilience.global_step >= STEPS:
            break
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if resilience.global_step >= STEPS:
            break
    resilience.close()  # exits with the stop's code after a stop
    print(f"FINISHED {resilience.global_step}", flush=True)  # one write: ranks share stdout


if __name__ == "__main__":
    {"lightning": lightning, "accelerate": accelerate}[sys.argv[1]](sys.argv[2])
