"""``AutoResume``: relaunch the same command and training continues from the newest committed checkpoint."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_resilience.checkpoint_io import ResilientCheckpointIO, live_checkpoint_ios
from lightning_resilience.session_callback import SessionCallback
from resilience.checkpoint import continuity
from resilience.errors import ConfigError, ResilienceError
from resilience.formats.names import write_resume_marker
from resilience.storage import catalog

# With this callback, fit(ckpt_path=None) resolving to the newest checkpoint is the point, and a first launch
# with nothing saved yet is normal; Lightning's warnings about both would only mislead.
_QUIET = (
    r"`\.fit\(ckpt_path=None\)` was called without a model\. The last model",
    r"\.fit\(ckpt_path=\"last\"\) is set, but there is no last checkpoint available",
)
_SEVERAL_MODEL_CHECKPOINTS = r"`\.\w+\(ckpt_path=\"best\"\)` is called with Trainer configured with multiple"


class AutoResume(SessionCallback, OnExceptionCheckpoint):
    """Makes ``trainer.fit(model)`` (and ``ckpt_path="last"``) resume from the newest committed checkpoint.

    Lightning turns ``fit(ckpt_path=None)`` into ``"last"`` when an ``OnExceptionCheckpoint`` is present, and
    ``"last"`` picks the newest of those callbacks' ``ckpt_path`` files; this subclass is that public hook. Its
    ``ckpt_path`` means "the newest checkpoint that verifies": the plugin resolves it at load time, on every rank
    together, skipping partial or corrupt checkpoints with a warning. With nothing committed yet it offers no
    path and training starts fresh. It saves nothing on exceptions (the health callback makes the emergency
    saves) and deletes nothing at the end, unlike its base class.

    Args:
        checkpoint_io: The plugin whose checkpoints to resume from; default: the one ``ResilientCheckpointIO``
            made in this process (as in a LightningCLI config, where objects cannot refer to each other).
    """

    def __init__(self, checkpoint_io: ResilientCheckpointIO | None = None) -> None:
        OnExceptionCheckpoint.__init__(self, dirpath=".", filename="resume")
        self._io = checkpoint_io
        self._replay_seed_draws = False
        for pattern in _QUIET:
            warnings.filterwarnings("ignore", message=pattern)

    @property
    def io(self) -> ResilientCheckpointIO:
        """The plugin given, else that of the Trainer this callback was last set up in, else the only one in the
        process."""
        return self._io_of(self._trainer)

    def _io_of(self, trainer: pl.Trainer | None) -> ResilientCheckpointIO:
        if self._io is not None:
            return self._io
        if trainer is not None and isinstance(trainer.strategy.checkpoint_io, ResilientCheckpointIO):
            return trainer.strategy.checkpoint_io
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
        trainer = _trainer_reading_ckpt_path() or self._trainer
        io = self._io_of(trainer)
        try:
            found = catalog.candidates(io.config.tiers())
        except ResilienceError:
            raise
        except Exception as exc:
            raise ConfigError(f"AutoResume could not list the checkpoints ({type(exc).__name__}: {exc})") from exc
        if not found:
            return None
        if trainer is not None and found[0].manifest is not None:
            # now, before the Trainer first asks its loggers for their folders (the profiler, ModelCheckpoint)
            continue_loggers(trainer, found[0].manifest.extra.get("logger_versions") or [], found[0].step)
        return write_resume_marker(io.config.local_root)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """No save here (one started from one rank's exception handler would wait forever for the others)."""
        SessionCallback.on_exception(self, trainer, pl_module, exception)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Nothing deleted: the base class would delete the newest checkpoint here."""
        SessionCallback.teardown(self, trainer, pl_module, stage)
        if sum(not isinstance(c, AutoResume) for c in trainer.checkpoint_callbacks) <= 1:
            # Lightning counts this callback among the ModelCheckpoints when validate(ckpt_path="best") follows
            # the fit: with one ModelCheckpoint of the user's, its warning about several would only mislead
            warnings.filterwarnings("ignore", message=_SEVERAL_MODEL_CHECKPOINTS)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        _warn_if_order_is_not_resumable(trainer)
        self._replay_seed_draws = self._io_of(trainer).resumed_at_epoch_end and trainer.global_step > 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._replay_seed_draws:
            # After validation, the saved run built each training loader's next-epoch iterator, and some of those
            # drew a seed from the global generator; the resumed run built its iterators before training started.
            self._replay_seed_draws = False
            for loader in _loaders(trainer.train_dataloader):
                if _draws_a_seed_each_epoch(loader):
                    torch.empty((), dtype=torch.int64).random_()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}


_PARSE_CKPT_PATH = _CheckpointConnector._parse_ckpt_path.__code__


def _trainer_reading_ckpt_path() -> pl.Trainer | None:
    """The Trainer whose ``fit``, ``validate``, ``test`` or ``predict`` is reading ``AutoResume.ckpt_path`` now.

    The pack's one look at its callers, for the one moment no hook reaches: Lightning reads ``ckpt_path`` in
    ``_CheckpointConnector._parse_ckpt_path``, before any hook of the run (callbacks' ``setup`` and the strategy's
    ``connect`` come after; by ``setup`` the loggers have chosen their folders). There ``AutoResume`` must know
    the Trainer: to give its loggers the saved run's versions before they choose, and to take that Trainer's
    plugin when several are alive (an in-place restart makes a second). Only that function's own frame counts,
    found among the nearest three (between it and the property sits its set comprehension before Python 3.12).
    Anyone else reading the property gets None, and the Trainer ``setup`` gave this callback.
    """
    frame = sys._getframe(1)
    for _ in range(3):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        if frame.f_code is _PARSE_CKPT_PATH:
            connector = frame.f_locals.get("self")
            return connector.trainer if isinstance(connector, _CheckpointConnector) else None
    return None


def continue_loggers(trainer: pl.Trainer, versions: list[Any], step: int) -> None:
    """Give each logger that has not chosen a version the one it had in the saved run
    (:mod:`resilience.checkpoint.continuity`).

    ``CSVLogger`` deletes an existing ``metrics.csv`` when it opens a version: the saved run's rows that the
    resumed run keeps are set aside first, then written back through its writer. A tracking service's logger
    can be given its run id only when it is made: a mismatch is reported with the fix.
    """
    took, others = continuity.continue_versions(trainer.loggers, versions)
    for logger in took:
        if isinstance(logger, CSVLogger) and trainer.is_global_zero:
            _keep_csv_rows(logger, step)
    for logger, version in others:
        rank_zero_warn(
            f"AutoResume: {type(logger).__name__} logs this resumed run as {logger.version!r}, the saved run "
            f"as {version!r}; to continue that run, give the logger its id (e.g. WandbLogger(id={version!r}, "
            "resume='allow'), MLFlowLogger(run_id=...))"
        )


def _keep_csv_rows(logger: CSVLogger, step: int) -> None:
    path = os.path.join(logger.log_dir, "metrics.csv")  # the file name Lightning's writer uses
    if not os.path.isfile(path):
        return
    with continuity.kept_rows(path, step) as rows:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
            experiment = logger.experiment
        experiment.metrics[:0] = rows
        experiment.save()


def _warn_if_order_is_not_resumable(trainer: pl.Trainer) -> None:
    """Say so when a mid-epoch resume cannot replay the data order, rather than letting it differ silently.

    Under DDP Lightning wraps the loader's sampler in its ``DistributedSamplerWrapper``; the wrapped shuffling
    sampler's generator is then not part of the ``StatefulDataLoader``'s state.
    """
    loader = trainer.train_dataloader
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if trainer.world_size > 1 and type(sampler).__name__ == "DistributedSamplerWrapper":
        rank_zero_warn(
            "AutoResume: the training data order cannot be resumed exactly mid-epoch under DDP with Lightning's "
            "distributed sampler wrapper. For exact resume, build the loader with torchdata's "
            "StatefulDistributedSampler and set Trainer(use_distributed_sampler=False) (see docs/LIGHTNING.md)"
        )


def _draws_a_seed_each_epoch(loader: Any) -> bool:
    """Whether starting an epoch of ``loader`` takes a number from the global generator.

    A ``DataLoader`` (torchdata's ``StatefulDataLoader`` is one) makes a new iterator for each epoch, and the
    iterator draws its workers' base seed from the loader's ``generator``, the global one when that is None; a
    sampler's own generator does not change it. With persistent workers the iterator is made once and reset
    for later epochs, drawing nothing. Any other iterable is left alone: nothing says what making its iterator
    draws, and most draw nothing.
    """
    return (
        isinstance(loader, DataLoader)
        and loader.generator is None
        and not (loader.persistent_workers and loader.num_workers > 0)
    )


def _loaders(train_dataloader: Any) -> list[Any]:
    """The data loaders in whatever collection the module returned from ``train_dataloader``."""
    if isinstance(train_dataloader, dict):
        return [loader for value in train_dataloader.values() for loader in _loaders(value)]
    if isinstance(train_dataloader, (list, tuple)):
        return [loader for value in train_dataloader for loader in _loaders(value)]
    return [] if train_dataloader is None else [train_dataloader]
