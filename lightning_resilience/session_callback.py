"""The Lightning hooks that drive the engine's training session; every callback of the pack is one of these.

Each pack callback adds its part to the session (health, interval, goodput, resume) when it is set up; the
hooks below are the same for all of them and idempotent in the session, so any one of them, or several,
drive the step boundary exactly once per optimizer step. They also tell the plugin its Trainer, which Lightning
never tells a CheckpointIO (``ResilientCheckpointIO.bind``): in ``setup``, which every stage runs before it loads a
checkpoint, and in ``on_save_checkpoint``, which runs before every full save (``Trainer.save_checkpoint`` after
``fit()`` too, when the plugin's teardown has unbound it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from lightning_resilience.launcher_observer import defer_lightning_kills
from resilience.session import TrainingSession


class SessionCallback(Callback):
    """Wires Lightning's fit hooks to the training session of the Trainer's ``ResilientCheckpointIO``."""

    _session: TrainingSession | None = None
    _paused: AbstractContextManager[None] | None = None
    _trainer: pl.Trainer | None = None  # from setup()

    def configure(self, session: TrainingSession, trainer: pl.Trainer) -> None:
        """Add this callback's part to the session (before training starts); collective where it must be."""

    def keep_after_fit(self, session: TrainingSession) -> None:
        """Copy from ``session`` what this callback still tells after the fit, whose end drops the session;
        called after every training batch, also one whose boundary stops the run."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        io = _bind(trainer)  # validate/test/predict(ckpt_path=...) load through the plugin too
        if stage != "fit":
            return
        if io is None:
            raise TypeError(
                f"{type(self).__name__} works through ResilientCheckpointIO: add it to the Trainer, "
                "Trainer(plugins=[ResilientCheckpointIO(...)]) (or strategy='resilient_ddp' under DDP)"
            )
        session = io.session  # collective: every rank runs setup
        if session is not self._session:
            self._session = session
            self.configure(session, trainer)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        _bind(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._session is not None:
            self._session.start(trainer.global_step)
            defer_lightning_kills(self._session)  # Lightning's launcher waits for the survivors' save or stop

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._session is not None:
            self._session.step_begin(trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        session = self._session
        if session is None:
            return
        try:
            # only at optimizer-step boundaries (global_step moved): a save mid-accumulation would lose gradients
            if session.started and session.last_step != trainer.global_step:
                boundary = session.step_end(trainer.global_step)
                if boundary.stop is not None:
                    session.exit()  # SystemExit with the stop's code, after the ledger and loggers are done
        finally:
            self.keep_after_fit(session)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._session is not None and trainer.training and self._paused is None:
            self._paused = self._session.paused()  # validation is not a hung training step
            self._paused.__enter__()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._paused is not None:
            self._paused.__exit__(None, None, None)
            self._paused = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        session, self._session = self._session, None
        if session is None or session.ended:
            return
        session.on_failure(exception)  # a lost peer: the survivors save and exit; else it goes on as it is
        session.end(exception, close_manager=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._session = None  # the plugin's teardown ends the session: last saves, ledger, monitors

    def __getstate__(self) -> dict[str, Any]:
        """``torch.save(trainer)`` pickles callbacks: the live session and the Trainer stay behind."""
        left = ("_session", "_paused", "_signals", "_trainer")
        return {key: value for key, value in self.__dict__.items() if key not in left}


def _bind(trainer: pl.Trainer) -> ResilientCheckpointIO | None:
    """Tell the Trainer's plugin, if it is the pack's, that this Trainer runs it; that plugin, or None."""
    io = trainer.strategy.checkpoint_io
    if not isinstance(io, ResilientCheckpointIO):
        return None
    io.bind(trainer)
    return io
