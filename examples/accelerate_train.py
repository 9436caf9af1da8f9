"""Resilient training with Hugging Face Accelerate: asynchronous checkpoints, exact resume, a clean stop on
preemption. The only additions to a plain Accelerate script are marked ``# resilience``.

Two CPU processes (on GPUs, drop --cpu):

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --cpu --ckpt /tmp/ckpt

Interrupt it any way you like (Ctrl-C, ``kill -9``, ``kill -TERM`` of one worker) and run the same command again:
it continues from the newest checkpoint with the batches and random numbers an uninterrupted run would have used.
``resilience report /tmp/ckpt`` then shows where the wall time of every run went (goodput, lost progress).
Every setting can come from the environment instead (``ACCELERATE_RESILIENCE_LOCAL_ROOT``, ``..._DURABLE_URL``,
``..._EVERY_N_STEPS``, ...; see docs/ACCELERATE.md), which is how ``accelerate launch`` configures plugins.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_resilience import ResiliencePlugin, attach


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="train on CPU processes (gloo)")
    parser.add_argument("--ckpt", default=None, help="local checkpoint directory")
    parser.add_argument("--durable-url", default=None, help="fsspec URL checkpoints are uploaded to, e.g. s3://b/run")
    parser.add_argument("--every", default="20", help="save every N optimizer steps, or 'auto' (Young/Daly)")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()

    accelerator = Accelerator(
        cpu=args.cpu,
        # A StatefulDataLoader with a seedable sampler resumes mid-epoch in the exact order; a plain DataLoader
        # works too (resumed by skipping batches).
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True),
    )
    set_seed(0)
    features = torch.randn(2048, 32)
    targets = features @ torch.randn(32, 1) + 0.1 * torch.randn(2048, 1)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * 2048 // 32)
    train_dl = DataLoader(TensorDataset(features, targets), batch_size=16, shuffle=True)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)

    every = args.every if args.every == "auto" else int(args.every)
    plugin = ResiliencePlugin(local_root=args.ckpt, durable_url=args.durable_url, every_n_steps=every, health=True)
    resilience = attach(accelerator, plugin)  # resilience
    point = resilience.resume()  # resilience: models, optimizer, scheduler, RNG, data position
    if point.restored:
        accelerator.print(f"resumed at epoch {point.epoch}, batch {point.batch_in_epoch}, step {point.global_step}")

    for epoch in range(point.epoch, args.epochs):
        model.train()
        # resilience: 0 batches to skip with a StatefulDataLoader; the trained ones with a plain DataLoader
        batches = accelerator.skip_first_batches(train_dl, point.batches_to_skip) if epoch == point.epoch else train_dl
        for x, y in resilience.timed(batches):  # resilience: data-wait figures and starvation warnings
            if resilience.should_stop():  # resilience: a preemption or GPU fault; this step is saved already
                break
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if resilience.should_stop():
            break
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, step {resilience.global_step}")
    if not resilience.should_stop():  # resilience: after a stop, that step is saved already
        resilience.save()  # resilience: the final state
    accelerator.end_training()  # waits for the last save; after a stop, exits with the code a launcher restarts on


if __name__ == "__main__":
    main()
