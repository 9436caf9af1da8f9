"""What the Lightning benchmark plugs into its fits besides Lightning's own parts and ours: the CheckpointIOs it
sets against ours (the floor, and DCP's process-based async save with a persistent stager, the recipe of
``benchmarks/dcp_recipe.py``, as a Lightning user would plug it in), how it waits for each CheckpointIO's saves, and
the callbacks that count saves and mark the end of training. Apart from ``dcp_recipe`` so that the Accelerate
benchmark, which shares the recipe, does not import Lightning (nor make DCP's process import it: that process
imports the main module again).

    .venv/bin/python -m benchmarks.lightning_io   # a self-check: a short fit saving through the DCP recipe,
                                                  # its last checkpoint loaded back with dcp.load and compared
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from benchmarks.common import HostCopy, now, tensors_in
from benchmarks.dcp_recipe import DcpProcessSaver
from lightning_resilience import AutoResume, ResilientCheckpointIO


class HostCopyIO(CheckpointIO):
    """The floor as a CheckpointIO: copies every tensor of the checkpoint into preallocated buffers, keeps nothing."""

    def __init__(self) -> None:
        self.copy = HostCopy()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.copy.copy(tensors_in(checkpoint))

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        raise NotImplementedError("the floor keeps nothing to load")

    def remove_checkpoint(self, path: Any) -> None:
        """Nothing was written."""


class DcpProcessIO(CheckpointIO):
    """Each checkpoint Lightning asks for as a DCP directory at its path (as Lightning's proposed
    ``DistributedAsyncCheckpointIO`` does), written by the recipe of ``benchmarks/dcp_recipe.py``.

    The whole checkpoint dict goes to DCP: the tensors as tensors, the rest (loops, callbacks' state, Adam's
    hyperparameters) as pickled bytes. A CheckpointIO sees no optimizer step, so the wait for the staging copy
    before the next update is a callback's (``callbacks()``: ``on_before_optimizer_step`` runs after the step's
    forward and backward, just before the update, so the copy overlaps them). ``teardown()`` (end of ``fit()``)
    waits for the last save, so a fit ends with its checkpoints complete, as with AsyncCheckpointIO and ours;
    ``close()``, after the benchmark's clock stops, frees the staging buffers and process groups (DCP's process
    stays for the next fit, as it stays for the life of a training process).
    """

    def __init__(self, async_staging: bool = True) -> None:
        self.saver = DcpProcessSaver(async_staging=async_staging)

    def callbacks(self) -> list[pl.Callback]:
        return [WaitForStaging(self.saver)]

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("storage_options are not supported by the DCP recipe")
        self.saver.save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        raise NotImplementedError(
            "DCP loads in place, into a state of the checkpoint's structure (dcp.load): the benchmark times saves"
        )

    def remove_checkpoint(self, path: Any) -> None:
        """After the save in flight (it may be this one), as Lightning's proposal does."""
        import shutil

        self.saver.wait()
        shutil.rmtree(path, ignore_errors=True)

    def teardown(self) -> None:
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()


class WaitForStaging(pl.Callback):
    """Holds each update back until the last save's staging copy is done (torchtitan's ``maybe_wait_for_staging``
    before ``optimizer.step()``)."""

    def __init__(self, saver: DcpProcessSaver) -> None:
        self.saver = saver

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.saver.wait_for_staging()


def staging_wait(io: CheckpointIO) -> float:
    """Seconds our engine, or the DCP recipe, has made optimizer steps wait for background staging so far."""
    if isinstance(io, DcpProcessIO):
        return io.saver.staging_wait_s
    return io.manager.stats.staging_wait_s if isinstance(io, ResilientCheckpointIO) else 0.0


def drain(io: CheckpointIO) -> None:
    """Wait until every save handed to ``io`` is complete, through the plugin's own means."""
    if isinstance(io, ResilientCheckpointIO):
        io.manager.wait()
        if io._names is not None:  # and the .ckpt files made from the committed steps, as a teardown waits
            io._names.wait()
    elif isinstance(io, AsyncCheckpointIO):
        io.teardown()  # waits for the queued saves; the next save starts a new thread
    elif isinstance(io, DcpProcessIO):
        io.saver.wait()


class Bound(pl.Callback):
    """Fails a fit in which our plugin does not know its Trainer: it would then write each ``.ckpt`` name on the
    training thread, as the plugin alone does, and the benchmark would time that instead of the background path."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, ResilientCheckpointIO) and io._trainer is not trainer:
            raise RuntimeError("ResilientCheckpointIO is not bound to this fit's Trainer: add a callback of the pack")


def variant_callbacks(io: CheckpointIO | None) -> list[pl.Callback]:
    """The callbacks a user adds with ``io``: for ours the README's ``AutoResume``, which also tells the plugin its
    Trainer (the plugin alone saves synchronously); for the DCP recipe its wait for the staging copy before the next
    update."""
    if isinstance(io, ResilientCheckpointIO):
        return [AutoResume(io), Bound()]
    if isinstance(io, DcpProcessIO):
        return io.callbacks()
    return []


class TrainingEnd(pl.Callback):
    """When training ended: after the last step and its save call, before the teardown waits for that save."""

    at = 0.0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at = now()


class CountedCheckpoint(ModelCheckpoint):
    """ModelCheckpoint counting the saves it makes."""

    saves = 0

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        self.saves += 1
        super()._save_checkpoint(trainer, filepath)


def _self_check() -> None:
    """A 4-step fit saving every 2 steps through ModelCheckpoint and ``DcpProcessIO``; the step-4 checkpoint, made
    after the last update, loaded back into fresh tensors of the model's and Adam's state, and compared."""
    import tempfile
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    from benchmarks.bench_lightning import Net, loader, trainer
    from benchmarks.dcp_recipe import end_checkpoint_process, zeroed_like

    torch.manual_seed(0)
    model = Net(width=128, layers=2)
    io = DcpProcessIO()
    with tempfile.TemporaryDirectory(prefix="dcp-lightning-") as root:
        names = ModelCheckpoint(dirpath=Path(root) / "names", every_n_train_steps=2, save_top_k=-1)
        run = trainer(4, Path(root), plugins=[io], callbacks=[names, *io.callbacks()])
        run.fit(model, loader(model, 4))
        written = sorted(p.name for p in (Path(root) / "names").iterdir())
        optimizer = run.optimizers[0]
        expected = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
        target = zeroed_like(expected) | {"global_step": -1}
        dcp.load(target, checkpoint_id=str(Path(root) / "names" / written[-1]), no_dist=True)
        io.close()
    end_checkpoint_process()
    assert written == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"], written
    assert target["global_step"] == 4, target["global_step"]
    for want, got in zip(tensors_in(expected), tensors_in(target), strict=True):
        assert torch.equal(want, got)
    print(
        f"lightning_io self-check passed: {io.saver.saves} saves through ModelCheckpoint ({', '.join(written)}, "
        f"DCP directories), the last loaded back with dcp.load equal to the model and Adam "
        f"({len(tensors_in(expected))} tensors) and its global_step; staging waits {io.saver.staging_wait_s:.4f} s."
    )


if __name__ == "__main__":
    _self_check()
