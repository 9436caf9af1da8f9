"""A small model and data module for the examples and tests: dropout, Adam with an LR schedule, and a
shuffled ``StatefulDataLoader`` whose position is saved, so a resumed run sees exactly the batches and random
numbers an uninterrupted one would."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A fixed regression set; the same on every rank and every run."""

    def __init__(self, n: int = 48, features: int = 16) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, features, generator=gen)
        self.y = self.x[:, :1] * 0.5 + 0.1 * torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class DemoModel(pl.LightningModule):
    """An MLP regressor.

    Args:
        hidden: Width of the hidden layer.
        lr: Adam learning rate; a StepLR decays it by 0.7 every 3 epochs.
    """

    def __init__(self, hidden: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


class DemoData(pl.LightningDataModule):
    """Shuffled batches from :class:`Points`.

    Args:
        batch_size: Samples per batch per rank.
        size: Samples in the set.
        loader: ``"stateful"``: ``StatefulDataLoader``; under DDP with a ``StatefulDistributedSampler`` (set
            ``Trainer(use_distributed_sampler=False)``), whose position is part of the loader's state.
            ``"lightning"``: ``StatefulDataLoader(shuffle=True)``, and Lightning inserts its distributed sampler
            wrapper under DDP. ``"plain"``: a ``torch.utils.data.DataLoader``, which has no position to save.
        num_workers: The loader's worker processes.
    """

    def __init__(self, batch_size: int = 4, size: int = 48, loader: str = "stateful", num_workers: int = 0) -> None:
        super().__init__()
        if loader not in ("stateful", "lightning", "plain"):
            raise ValueError(f"loader={loader!r}: use 'stateful', 'lightning' or 'plain'")
        self.batch_size = batch_size
        self.size = size
        self.loader = loader
        self.num_workers = num_workers

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        data = Points(self.size)
        if self.loader == "plain":
            return DataLoader(data, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)
        if self.loader == "stateful" and self.trainer is not None and self.trainer.world_size > 1:
            # the strategy's data-parallel ranks: under tensor parallelism the ranks of a group share batches
            sampler = StatefulDistributedSampler(
                data, shuffle=True, seed=0, **self.trainer.strategy.distributed_sampler_kwargs
            )
            return StatefulDataLoader(data, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)
        return StatefulDataLoader(data, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)
