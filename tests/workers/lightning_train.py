"""A small Lightning training run used by the tests: shuffled StatefulDataLoader, dropout, Adam, LR schedule.

Launched as a script (Lightning starts the other DDP rank by re-running it). ``--kill-at K`` makes the run
SIGKILL itself after step K once the newest checkpoint is committed; relaunching the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from lightning_resilience import AutoResume, HealthGuardCallback, ResilientCheckpointIO


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 48) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Net(pl.LightningModule):
    def __init__(self, loader: str) -> None:
        super().__init__()
        self.loader = loader
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)}

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        if self.loader == "plain":
            return DataLoader(Points(), batch_size=4, shuffle=True)
        if self.trainer.world_size > 1:  # a sampler whose position is part of the loader's state
            sampler = StatefulDistributedSampler(Points(), shuffle=True, seed=0)
            return StatefulDataLoader(Points(), batch_size=4, sampler=sampler)
        return StatefulDataLoader(Points(), batch_size=4, shuffle=True)


class KillAfter(pl.Callback):
    """SIGKILL this process after a step, once the checkpoints saved so far are committed."""

    def __init__(self, step: int, io: ResilientCheckpointIO) -> None:
        self.step, self.io = step, io

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            self.io.manager.wait()
            trainer.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


class Sleep(pl.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: object) -> None:
        import time

        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--durable")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--loader", default="stateful")
    p.add_argument("--out")
    p.add_argument("--async-staging", action="store_true")
    p.add_argument("--health", action="store_true", help="add HealthGuardCallback (faults via RESILIENCE_INJECT)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to leave time for a signal")
    args = p.parse_args()

    pl.seed_everything(7, workers=True)
    io = ResilientCheckpointIO(
        os.path.join(args.root, "ckpt"),
        durable_url=args.durable,
        storage_options=json.loads(os.environ.get("TEST_STORAGE_OPTIONS", "{}")),
        async_staging=args.async_staging,
    )
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=os.path.join(args.root, "names"), every_n_train_steps=args.every, save_top_k=-1),
        AutoResume(),
    ]
    if args.kill_at is not None:
        callbacks.append(KillAfter(args.kill_at, io))
    if args.health:
        callbacks.append(HealthGuardCallback(grace_s=60, nvml=True))
    if args.step_sleep:
        callbacks.append(Sleep(args.step_sleep))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="resilient_ddp" if args.devices > 1 else "auto",
        plugins=[io],
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=pl.loggers.CSVLogger(args.root, name="logs", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
        deterministic=True,
        use_distributed_sampler=args.loader == "plain",
    )
    trainer.fit(Net(args.loader))
    if args.out and trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}, args.out)
    print("FINISHED", trainer.global_step, trainer.current_epoch)


if __name__ == "__main__":
    main()
