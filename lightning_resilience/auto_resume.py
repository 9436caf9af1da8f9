"""``AutoResume``: relaunch the same command and training continues from the newest committed checkpoint."""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lightning_resilience.checkpoint_io import ResilientCheckpointIO, live_checkpoint_ios
from lightning_resilience.pointer import write_pointer
from resilience import catalog
from resilience.rng import capture_rng, restore_rng
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
            if isinstance(callback, ModelCheckpoint):
                for path in [*callback.best_k_models, callback.last_model_path, callback.best_model_path]:
                    if path:
                        self.io.remember_alias(path)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pending = self.io.pending_rng
        if pending is not None and pending.at_epoch_start:
            self._apply(pending.state)
        elif pending is not None and pending.epoch_start_state is not None:
            restore_rng(pending.epoch_start_state)  # the resumed epoch's iterator draws what the saved one drew
        self.io.epoch_start_rng = capture_rng()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pending = self.io.pending_rng
        if pending is not None:
            self._apply(pending.state)

    def _apply(self, state: dict[str, Any]) -> None:
        restore_rng(state)
        self.io.pending_rng = None

    def state_dict(self) -> dict[str, Any]:
        return {}
