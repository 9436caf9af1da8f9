"""Lightning's test_model_torch_save_ddp_cpu with the pack's strategy: a 2-rank fit on CPU, then
``torch.save(trainer)`` and ``torch.load`` of it on each rank.

Usage: lightning_pickle.py ROOT. Lightning's launcher runs this script again as rank 1. Each rank writes
ROOT/trainer-rank<R>.pt and, once it loaded it back, ROOT/rank<R>.ok.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_resilience import ResilientCheckpointIO


def main() -> None:
    root = Path(sys.argv[1])
    trainer = Trainer(
        default_root_dir=root,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        strategy="resilient_ddp",
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        plugins=[ResilientCheckpointIO(local_root=str(root / "engine"))],
    )
    trainer.fit(BoringModel())
    path = root / f"trainer-rank{trainer.global_rank}.pt"
    torch.save(trainer.model, path)
    torch.save(trainer, path)
    loaded = torch.load(path, weights_only=False)
    assert loaded.global_step == trainer.global_step == 4
    (root / f"rank{trainer.global_rank}.ok").touch()


if __name__ == "__main__":
    main()
