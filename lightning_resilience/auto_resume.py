"""``AutoResume``: relaunch the same command and training continues from the newest committed checkpoint."""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lightning_resilience.checkpoint_io import ResilientCheckpointIO, live_checkpoint_ios
from lightning_resilience.pointer import write_pointer
from resilience import catalog
from resilience.rng import restore_rng
from resilience.storage import Tier

# With this callback, fit(ckpt_path=None) resolving to the newest checkpoint is the point, and a first launch
# with nothing saved yet is normal; Lightning's warnings about both would only mislead.
_QUIET = (
    r"`\.fit\(ckpt_path=None\)` was called without a model\. The last model",
    r"\.fit\(ckpt_path=\"last\"\) is set, but there is no last checkpoint available",
)


class AutoResume(OnExceptionCheckpoint):
    """Makes ``trainer.fit(model)`` (and ``ckpt_path="last"``) resume from the newest committed checkpoint.

    Lightning turns ``fit(ckpt_path=None)`` into ``"last"`` when an ``OnExceptionCheckpoint`` is present, and
    ``"last"`` picks the newest of those callbacks' ``ckpt_path`` files; this subclass is that public hook. Its
    ``ckpt_path`` is a pointer meaning "the newest checkpoint that verifies"; the plugin resolves it at load
    time, on every rank together, skipping partial or corrupt checkpoints with a warning. With nothing
    committed yet it offers no path and training starts fresh.

    It saves nothing on exceptions (the health callbacks handle emergency saves) and deletes nothing at the
    end, unlike its base class. It also protects the checkpoints the restored ``ModelCheckpoint`` callbacks
    still refer to (best-k, last) from retention.

    Args:
        checkpoint_io: The plugin whose checkpoints to resume from; default: the one ``ResilientCheckpointIO``
            made in this process (as in a LightningCLI config, where objects cannot refer to each other).
    """

    def __init__(self, checkpoint_io: ResilientCheckpointIO | None = None) -> None:
        super().__init__(dirpath=".", filename="resume")
        self._io = checkpoint_io
        for pattern in _QUIET:
            warnings.filterwarnings("ignore", message=pattern)

    @property
    def io(self) -> ResilientCheckpointIO:
        if self._io is not None:
            return self._io
        found = live_checkpoint_ios()
        if len(found) != 1:
            raise RuntimeError(
                f"AutoResume found {len(found)} ResilientCheckpointIO plugins in this process: pass the one to "
                "resume from, AutoResume(checkpoint_io=...)"
            )
        return found[0]

    @property
    def ckpt_path(self) -> str | None:  # type: ignore[override]
        """Evaluated by Lightning before the process group exists, so it only reads storage (same on every rank)."""
        config = self.io.config
        tiers = [Tier("local", config.local_root)]
        if config.durable_url:
            tiers.append(Tier("durable", config.durable_url, config.storage_options))
        if not catalog.candidates(tiers):
            return None
        path = os.path.join(config.local_root, "resume.ckpt")
        write_pointer(path, self.io.pointer("latest"))
        return path

    def on_exception(self, trainer: pl.Trainer, *_: Any, **__: Any) -> None:
        """Nothing: a save started from one rank's exception handler would wait forever for the others."""

    def teardown(self, trainer: pl.Trainer, *_: Any, **__: Any) -> None:
        """Nothing: the base class would delete the newest checkpoint here."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath and os.path.isdir(callback.dirpath):
                for name in os.listdir(callback.dirpath):  # every name it still has protects its checkpoint
                    if name.endswith(ModelCheckpoint.FILE_EXTENSION):
                        self.io.remember_alias(os.path.join(callback.dirpath, name))
        _warn_if_order_is_not_resumable(trainer)
        pending = self.io.pending_rng
        if pending is not None and pending.at_epoch_start:
            # What the saved run did after its epoch's last step (validation, epoch-end hooks) comes next here
            # too, so it starts from the same generator state.
            restore_rng(pending.state)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pending = self.io.pending_rng
        if pending is None:
            return
        self.io.pending_rng = None
        if not pending.at_epoch_start:
            restore_rng(pending.state)
            return
        # After validation, the saved run built each training loader's next-epoch iterator, and each drew a
        # seed from the global generator; the resumed run built its iterators before on_train_start.
        for loader in _loaders(trainer.train_dataloader):
            if getattr(loader, "generator", None) is None:
                torch.empty((), dtype=torch.int64).random_()

    def state_dict(self) -> dict[str, Any]:
        return {}


def _warn_if_order_is_not_resumable(trainer: pl.Trainer) -> None:
    """Say so when a mid-epoch resume cannot replay the data order, rather than letting it differ silently.

    Under DDP Lightning wraps the loader's sampler in its ``DistributedSamplerWrapper``; the wrapped shuffling
    sampler's generator is then not part of the ``StatefulDataLoader``'s state.
    """
    loader = trainer.train_dataloader
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if trainer.world_size > 1 and type(sampler).__name__ == "DistributedSamplerWrapper" and trainer.is_global_zero:
        warnings.warn(
            "AutoResume: the training data order cannot be resumed exactly mid-epoch under DDP with Lightning's "
            "distributed sampler wrapper. For exact resume, build the loader with torchdata's "
            "StatefulDistributedSampler and set Trainer(use_distributed_sampler=False) (see docs/LIGHTNING.md)",
            stacklevel=2,
        )


def _loaders(train_dataloader: Any) -> list[Any]:
    """The data loaders in whatever collection the module returned from ``train_dataloader``."""
    if isinstance(train_dataloader, dict):
        return [loader for value in train_dataloader.values() for loader in _loaders(value)]
    if isinstance(train_dataloader, (list, tuple)):
        return [loader for value in train_dataloader for loader in _loaders(value)]
    return [] if train_dataloader is None else [train_dataloader]
