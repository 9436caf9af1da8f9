"""The demo model sharded by ``configure_model`` (FSDP2, tensor parallel or HSDP) and trained by a real Trainer
on 1 or 2 CPU ranks (gloo), for tests/test_lightning_sharded.py.

Launched as a script (Lightning starts rank 1 by re-running it). ``--layout`` is how ``configure_model``
parallelises (``fsdp``: ``fully_shard`` over the data-parallel mesh; ``tp``: ``parallelize_module`` over the
tensor-parallel one; ``hsdp``: ``fully_shard`` over the whole 2-D mesh, replicated along its first dimension),
``--dp``/``--tp`` the strategy's mesh. ``--stock`` trains with Lightning's own ``ModelParallelStrategy`` and no
pack at all (it reads the pack's names as its own checkpoints). Full (gathered) states go to files written by
rank 0: ``--out`` after training, ``--snapshot-at K [K ...]`` after those steps (``snapshot-<K>.pt`` in
``--snapshots``), ``--restored`` right after a resume.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from examples.demo_model import DemoData, DemoModel
from lightning_resilience import AutoResume, ResilientCheckpointIO, ResilientModelParallelStrategy
from tests.workers.victim import die_after_boundary

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class ShardedDemo(DemoModel):
    """The demo MLP, parallelised in ``configure_model`` as a model-parallel user does it."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if self.layout == "tp":
            parallelize_module(self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "3": RowwiseParallel()})
            return
        shard_over = mesh if self.layout == "hsdp" else mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=shard_over)
        fully_shard(self.net, mesh=shard_over)


def full_state(trainer: pl.Trainer) -> dict[str, Any]:
    """Parameters and optimizer state gathered to full tensors, keyed by parameter name (collective)."""
    model = trainer.strategy.model
    assert model is not None
    optimizer = trainer.optimizers[0]
    return {
        "model": get_model_state_dict(model, options=FULL),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=FULL),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": trainer.global_step,
    }


class Record(pl.Callback):
    """Writes full states (rank 0) where the test asks, SIGKILLs the run after a committed step, or rank 1 alone
    as a step begins (``--lose-rank-1-at``: the survivor, rank 0, is in a collective with it)."""

    def __init__(self, args: argparse.Namespace, io: ResilientCheckpointIO | None) -> None:
        self.args, self.io = args, io

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.args.restored:
            self._write(trainer, self.args.restored)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.args.lose_rank_1_at and trainer.global_rank == 1:
            assert self.io is not None
            die_after_boundary(self.io.session, trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step in self.args.snapshot_at:
            self._write(trainer, os.path.join(self.args.snapshots, f"snapshot-{trainer.global_step}.pt"))
        if trainer.global_step == self.args.kill_at:
            assert self.io is not None
            self.io.manager.wait()
            trainer.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _write(trainer: pl.Trainer, path: str) -> None:
        state = full_state(trainer)
        if trainer.global_rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--layout", default="fsdp", choices=["fsdp", "tp", "hsdp"])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--lose-rank-1-at", type=int)
    p.add_argument("--snapshot-at", type=int, nargs="*", default=[])
    p.add_argument("--snapshots", help="the folder --snapshot-at writes into")
    p.add_argument("--restored", help="write the full state right after the resume here")
    p.add_argument("--out", help="write the full state after training here")
    p.add_argument("--ckpt-path", help="pass this ckpt_path to fit()")
    p.add_argument("--stock", action="store_true", help="Lightning's own ModelParallelStrategy, no pack")
    p.add_argument("--async-staging", action="store_true")
    args = p.parse_args()

    pl.seed_everything(7, workers=True)
    devices = args.dp * args.tp
    io = None
    callbacks: list[pl.Callback] = []
    if args.stock:
        strategy: Any = ModelParallelStrategy(data_parallel_size=args.dp, tensor_parallel_size=args.tp)
    else:
        io = ResilientCheckpointIO(
            os.path.join(args.root, "ckpt"), keep_last=args.keep_last, async_staging=args.async_staging
        )
        strategy = ResilientModelParallelStrategy(
            data_parallel_size=args.dp, tensor_parallel_size=args.tp, checkpoint_io=io
        )
        callbacks += [
            ModelCheckpoint(dirpath=os.path.join(args.root, "names"), every_n_train_steps=args.every, save_top_k=-1),
            AutoResume(),
        ]
    callbacks.append(Record(args, io))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
        deterministic=True,
        use_distributed_sampler=False,
    )
    trainer.fit(ShardedDemo(args.layout), DemoData(), ckpt_path=args.ckpt_path)
    state = full_state(trainer)
    if args.out and trainer.global_rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.out)
    print(f"FINISHED {trainer.global_step} {trainer.current_epoch}", flush=True)  # one write: ranks share stdout
    if torch.distributed.is_initialized():  # Lightning leaves the group up; its gloo threads once aborted the exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
