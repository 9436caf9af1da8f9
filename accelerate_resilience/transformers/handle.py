"""``attach_trainer()``: the Hugging Face Trainer's checkpoints through the pack's engine.

The Trainer saves and resumes on its own (``checkpoint-N`` folders, written synchronously, loaded unchecked) and
has no checkpoint plugin, so ``attach()`` on its Accelerator never sees those saves. The handle takes the place of
the few Trainer methods that save and load (:mod:`accelerate_resilience.transformers.compat` names them) on the one
Trainer given, and a :class:`ResilienceCallback` drives the engine's
:class:`~resilience.session.TrainingSession` from the Trainer's events. What the Trainer decides stays the
Trainer's: when to save (``save_steps``, ``save_strategy``), which batches a resumed run skips (from the global
step, as for its own checkpoints) and when the RNG streams come back. The pack decides where the bytes go: every
save asynchronous, committed by a manifest, verified at resume; the Trainer's ``checkpoint-N`` folders are made
from the committed steps (:mod:`accelerate_resilience.transformers.folders`). See ``docs/TRANSFORMERS.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import TrainOutput

from accelerate_resilience import compat as accelerate_compat
from accelerate_resilience.plugin import ResiliencePlugin
from accelerate_resilience.transformers import compat
from accelerate_resilience.transformers.folders import TrainerFolders
from resilience.checkpoint.loader import Restored
from resilience.checkpoint.manager import CheckpointManager
from resilience.checkpoint.rng import capture_rng, restore_rng
from resilience.checkpoint.staging import barrier_for
from resilience.config import auto_persist
from resilience.errors import ConfigError
from resilience.health import HealthConfig
from resilience.logs import print_to_stderr, rank_zero
from resilience.persist.fork_server import stop_early_server
from resilience.recovery.peer_loss import BoundarySnapshot
from resilience.session import SaveState, TrainingSession
from resilience.storage.layout import parse_step_dirname, step_dirname

log = logging.getLogger(__name__)
KEEP_ALL = sys.maxsize  # no save_total_limit: the Trainer keeps every checkpoint, and so does the pack
# the parts of a checkpoint other than the model's weights (what loading the best model leaves out)
_NOT_WEIGHTS = ("optimizer", "scheduler", "scaler", "trainer_state")


@dataclass
class _Resumed:
    """A checkpoint restored for ``train()``, until its parts are in place: the weights were loaded into
    ``model`` in place; the Trainer reads ``folder``, which holds the checkpoint's ``trainer_state.json``."""

    restored: Restored
    folder: str
    model: torch.nn.Module
    in_place: bool = False  # optimizer, scheduler and scaler loaded, and the session told


class ResilienceCallback(TrainerCallback):
    """The Trainer's events that drive the session: training begins (the resumed state goes in place, the session
    starts), each optimizer step begins (data wait), an epoch ends (after an agreed stop, nothing more runs).

    Made and added by :func:`attach_trainer`; the step boundary itself is the end of the Trainer's
    log-save-evaluate pass, which no event marks (:meth:`TrainerResilience._maybe_log_save_evaluate`).
    """

    def __init__(self, handle: TrainerResilience):
        self.handle = handle

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.handle._begin()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        session = self.handle.session
        if session is not None and session.started:
            session.step_begin(state.global_step)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        session = self.handle.session
        if session is not None and session.stopping is not None:
            compat.stop_control(control)  # the epoch's evaluation and save would eat the stop's grace


class TrainerResilience:
    """Saves and resumes a Trainer's checkpoints through the asynchronous checkpoint engine.

    Made by :func:`attach_trainer`. Every ``trainer.train()`` opens a session (collective: call it on every
    rank, as the Trainer requires anyway) and ends it when training ends: the last saves are committed before
    ``train()`` returns. Attributes while training: ``session`` (``session.ledger``: the goodput ledger) and
    ``manager`` (the engine); ``run_dir``, where the ledger lives.
    """

    def __init__(self, trainer: Trainer, plugin: ResiliencePlugin, health: HealthConfig | None):
        compat.refuse_unsupported(trainer)
        if accelerate_compat.replaced(trainer, "train") is not None:
            raise ConfigError("this Trainer already has the pack attached: attach once, and close() it first")
        self.trainer = trainer
        self.plugin = plugin
        self._health = health
        self.run_dir = os.fspath(plugin.run_dir or compat.output_dir(trainer))
        self.session: TrainingSession | None = None
        self.manager: CheckpointManager | None = None
        self._folders: TrainerFolders | None = None
        self._resumed: _Resumed | None = None
        self._own = {name: getattr(trainer, name) for name in (*compat.ROUTED, compat.BEST_MODEL)}
        print_to_stderr(rank_zero)
        self.callback = ResilienceCallback(self)
        trainer.add_callback(self.callback)
        for name in (*compat.ROUTED, compat.BEST_MODEL):
            accelerate_compat.replace(trainer, name, getattr(self, name))
        self._closed = False

    # ---- the session, one per train() --------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        """``Trainer.train``, with a session around it. ``resume_from_checkpoint=True`` resumes from the newest
        checkpoint that verifies (with none, from a ``checkpoint-N`` folder of the Trainer's own, else from the
        start); a ``<local_root>/step-N`` path from that step; any other path as the Trainer would."""
        if trial is not None:
            raise ConfigError(
                "hyperparameter_search runs each trial with checkpoints of its own, which the pack does not keep "
                "apart: close() the handle before the search, and attach again after it"
            )
        self._check_open()
        session = self._open()
        try:
            folder = self._restore(session, resume_from_checkpoint)
            self._checkpoint_folders().check_free(self._resumed.restored.step if self._resumed else self._start(folder))
            if self._resumed is not None and compat.finished(self.trainer, self._resumed.restored.step):
                output = self._nothing_left(session, self._resumed.restored)
            else:
                output = self._own["train"](resume_from_checkpoint=folder, **kwargs)
        except BaseException as exc:
            session.on_failure(exc)  # a lost peer: the survivors save and exit; else it goes on as it is
            session.end(exc)
            raise
        finally:
            self._forget_resumed()
        if session.stopping is not None:
            session.exit()  # the stop's code, once the Trainer's own end of training ran
        try:
            self._checkpoint_folders().settle()  # every folder there before train() returns, as the Trainer's own are
        finally:
            session.end()
        return output

    @staticmethod
    def _start(folder: str | None) -> int:
        """The step a run resumed from the Trainer's own folder ``folder`` starts at (0: from the start)."""
        return compat.checkpoint_step(folder) if folder is not None else 0

    def _nothing_left(self, session: TrainingSession, restored: Restored) -> TrainOutput:
        """A run resumed at its ``max_steps``: the Trainer would train one step more (its loop checks the step count
        only after a step); with the weights in place already, this run only takes the checkpoint's state."""
        trainer = self.trainer
        compat.take_state(trainer, restored.state["trainer_state"])
        session.restored(restored, position=f"global step {trainer.state.global_step}: max_steps reached")
        if trainer.args.process_index == 0:
            log.info("Step %d is max_steps already: nothing left to train", trainer.state.global_step)
        return TrainOutput(trainer.state.global_step, 0.0, {})

    def _open(self) -> TrainingSession:
        """A session and engine for this ``train()`` call; collective."""
        trainer, args = self.trainer, self.trainer.args
        limit = args.save_total_limit
        model = compat.model(trainer)
        config = self.plugin.checkpoint_config(
            local_root=os.path.join(compat.output_dir(trainer), "resilience"),
            keep_last=max(2, limit) if limit and limit > 0 else KEEP_ALL,
            auto=auto_persist([model], args.world_size),
        )
        if config.persist == "thread":
            stop_early_server()
        self.manager = CheckpointManager(barrier_for(config, [model]), protected_steps=self._protected)
        self._folders = TrainerFolders(trainer, self.manager)
        session = TrainingSession(
            self.manager, self._state, is_main=args.process_index == 0, boundary=self._boundary_snapshot
        )
        session.add_sink(self._log)
        cuda = trainer.accelerator.device.type == "cuda"
        self.plugin.configure(session, run_dir=self.run_dir, cuda=cuda, health=self._health)
        self.session = session
        return session

    def _protected(self) -> set[int]:
        """Retention keeps the best checkpoint, as the Trainer's own rotation does, and the steps whose folders are
        still to be written."""
        best = self.trainer.state.best_global_step
        pending = self._folders.pending_steps() if self._folders is not None else set()
        return pending | ({best} if best else set())

    def _begin(self) -> None:
        """Training begins (``on_train_begin``: optimizer and scheduler made and prepared): the resumed state in
        place, then the session started; collective."""
        session = self.session
        if session is None or session.started:
            return
        self._checkpoint_folders().prepare()
        resumed = self._resumed
        if resumed is not None and not resumed.in_place:
            self._load_loop_state(resumed.restored)
            resumed.in_place = True
            state = self.trainer.state
            session.restored(resumed.restored, position=f"epoch {state.epoch:.2f}, global step {state.global_step}")
        session.start(self.trainer.state.global_step)

    # ---- save ---------------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's save, in the background: every rank stages its part, and the engine writes, commits and
        rotates (``save_total_limit``) while training goes on; then rank 0 makes its ``checkpoint-N`` folder.
        Collective, as the Trainer's own is."""
        session, folders = self._session(), self._checkpoint_folders()
        trainer = self.trainer
        if compat.tracks_best(trainer):
            best = trainer.state.best_global_step
            if best == trainer.state.global_step or best in session.manager.committed_steps():
                trainer.state.best_model_checkpoint = folders.path(best) if folders.enabled else self.step_path(best)
        handle = session.save(trainer.state.global_step)
        if handle is not None:
            folders.name(handle)

    def _state(self, step: int) -> SaveState:
        """What a save holds (the session's state builder, on every rank at once): the flops counted so far go into
        the state first, as the Trainer's own save does (a collective under DDP)."""
        self.trainer.store_flos()
        return self._boundary_snapshot(step).shared()

    def _boundary_snapshot(self, step: int) -> BoundarySnapshot:
        """The state at ``step``'s boundary: this rank's RNG streams and sampler seed by value now; the shared state
        (weights, optimizer, scheduler, scaler, ``trainer_state.json``) when it is saved, from the live objects."""
        trainer = self.trainer
        rank_state = {"rng_streams": capture_rng(), "sampler_seed": self._sampler_seed()}
        rank_state.update(self._checkpoint_folders().rank_state())  # rank 0: what its folder holds beside the step

        def shared() -> SaveState:
            loop = compat.step_loop_objects(trainer)
            state = {
                "model": compat.model(trainer).state_dict(),
                "optimizer": loop["optimizer"].state_dict(),
                "scheduler": loop["scheduler"].state_dict(),
                "scaler": loop["scaler"].state_dict() if loop["scaler"] is not None else None,
                "trainer_state": compat.trainer_state_json(trainer),
            }
            extra = {"adapter": "transformers", "global_step": step, "epoch": trainer.state.epoch}
            return SaveState(state, rank_state, extra)

        return BoundarySnapshot(step, rank_state, shared)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, evaluate and save after an optimizer step; its end is the step boundary: the state
        there is the one the Trainer's own saves hold (after the step's evaluation, which draws from the RNG), so
        the session's saves (interval, emergency) resume exactly as the Trainer's do. An agreed stop leaves the
        loop through the Trainer's own ``should_training_stop``."""
        session, control = self.session, self.trainer.control
        pause = session.paused() if session is not None and control.should_evaluate else contextlib.nullcontext()
        with pause:  # an evaluation is not a hung training step
            self._own["_maybe_log_save_evaluate"](*args, **kwargs)
        step = self.trainer.state.global_step
        if session is None or not session.started or session.last_step == step:
            return
        boundary = session.step_end(step)
        if boundary.stop is not None:
            compat.stop_control(self.trainer.control)

    def step_path(self, step: int) -> str:
        """Where checkpoint ``step`` lies in the local tier (``trainer.state.best_model_checkpoint`` names it where
        no folder is written)."""
        return os.path.join(self._session().manager.local.root, step_dirname(step))

    # ---- resume -------------------------------------------------------------------------------------------------

    def _restore(self, session: TrainingSession, wanted: str | bool | None) -> str | None:
        """Load what ``resume_from_checkpoint`` asks for (collective); the folder to hand the Trainer instead."""
        if wanted is None or wanted is False:
            return None
        step = None
        if isinstance(wanted, str):
            step = self._pack_step(wanted)
            if step is None:
                return wanted  # a checkpoint-N folder of the Trainer's own: loaded as the Trainer loads it
        restored = session.restore(
            {"model": compat.model(self.trainer).state_dict()},
            step=step,
            per_rank="each rank's RNG streams (the batches to skip come from the global step, as the Trainer's own)",
        )
        if restored is None:
            session.restored(None)
            stock = compat.last_stock_checkpoint(self.trainer)
            if stock is None and self.trainer.args.process_index == 0:
                log.info("No checkpoint to resume from in %s: training starts at step 0", session.manager.local.root)
            return stock
        folder = tempfile.mkdtemp(prefix=f"resilience-resume-{step_dirname(restored.step)}-")
        with open(os.path.join(folder, compat.TRAINER_STATE_NAME), "w", encoding="utf-8") as out:
            out.write(restored.state["trainer_state"])
        self._resumed = _Resumed(restored, folder, compat.model(self.trainer))
        return folder

    def _pack_step(self, path: str) -> int | None:
        """The step a ``<local_root>/step-N`` path names, or an ``<output_dir>/checkpoint-N`` folder the pack made
        from a step it still holds, or one not there (where the pack saved step N); None for any other path (the
        Trainer loads it as its own). Collective."""
        path = os.path.normpath(path)
        folder, name = os.path.split(path)
        if same_path(folder, self._session().manager.local.root):
            return parse_step_dirname(name)
        if same_path(folder, compat.output_dir(self.trainer)):
            step = self._checkpoint_folders().step_of(path)
            return compat.stock_step(name) if step is None and not os.path.isdir(path) else step
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """The Trainer's weight load: the pack's were loaded in place already (into a model that ``model_init``
        replaced since, they are copied over)."""
        resumed = self._resumed
        if resumed is None or resume_from_checkpoint != resumed.folder:
            return self._own["_load_from_checkpoint"](resume_from_checkpoint, model)
        model = model if model is not None else compat.model(self.trainer)
        if model is not resumed.model:
            model.load_state_dict(resumed.restored.state["model"])
        return None

    def _load_loop_state(self, restored: Restored) -> None:
        """Optimizer, scheduler and scaler (the Trainer makes them after its weight load), and the sampler seed."""
        state, loop = restored.state, compat.step_loop_objects(self.trainer)
        loop["optimizer"].load_state_dict(state["optimizer"])
        loop["scheduler"].load_state_dict(state["scheduler"])
        if loop["scaler"] is not None and state["scaler"] is not None:
            loop["scaler"].load_state_dict(state["scaler"])
        seed = restored.rank_state["sampler_seed"] if restored.rank_state is not None else None
        sampler = self._sampler()
        if seed is not None and sampler is not None:
            sampler.initial_seed = seed  # the same shuffles, however this relaunch seeded torch

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """The Trainer restores the RNG streams where its resume needs them (after skipping the trained batches):
        this rank's, from the checkpoint; none when it was saved by another number of processes."""
        resumed = self._resumed
        if resumed is None or checkpoint != resumed.folder:
            return self._own["_load_rng_state"](checkpoint)
        rank_state = resumed.restored.rank_state
        if rank_state is not None:
            restore_rng(rank_state["rng_streams"])
        return None

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best step's weights, verified, from the pack's checkpoint (not after a
        stop: the process is about to exit)."""
        session, trainer = self._session(), self.trainer
        path = trainer.state.best_model_checkpoint or ""
        in_folder = compat.stock_step(os.path.basename(path)) is not None  # a checkpoint-N folder, else a step-N
        best = self._checkpoint_folders().step_of(path) if in_folder else parse_step_dirname(path)
        if best is None:
            return self._own[compat.BEST_MODEL]()
        if session.stopping is not None:
            return None
        log.info(
            "Loading the best model, step %d (%s: %s)",
            best,
            trainer.args.metric_for_best_model,
            trainer.state.best_metric,
        )
        session.manager.load(
            {"model": compat.model(trainer).state_dict()}, step=best, rank_state=False, leave_out=_NOT_WEIGHTS
        )
        return None

    def _forget_resumed(self) -> None:
        if self._resumed is not None:
            shutil.rmtree(self._resumed.folder, ignore_errors=True)
            self._resumed = None

    # ---- the training loader's sampler -----------------------------------------------------------------------

    def _sampler(self) -> Any:
        loader = self.trainer.callback_handler.train_dataloader
        sampler = getattr(loader, "get_sampler", lambda: None)()
        return sampler if hasattr(sampler, "initial_seed") else None

    def _sampler_seed(self) -> int | None:
        """The shuffle's seed (Accelerate's seedable sampler shuffles epoch e with ``initial_seed + e``)."""
        sampler = self._sampler()
        return int(sampler.initial_seed) if sampler is not None else None

    # ---- metrics, close ----------------------------------------------------------------------------------------

    def _log(self, metrics: dict[str, float]) -> None:
        """The pack's metrics to the Trainer's integrations (``report_to``), from the main process; not into
        ``state.log_history``, which would make the saved state depend on save timings."""
        trainer = self.trainer
        if trainer.args.process_index == 0:
            handler = trainer.callback_handler
            trainer.control = handler.on_log(trainer.args, trainer.state, trainer.control, logs=dict(metrics))

    def close(self) -> None:
        """Give the Trainer its own methods back and remove the callback (not during ``train()``)."""
        if self._closed:
            return
        if self.session is not None and not self.session.ended:
            raise ConfigError("close() during train(): close the handle after train() returns")
        self._closed = True
        accelerate_compat.put_back(self.trainer, *compat.ROUTED, compat.BEST_MODEL)
        self.trainer.remove_callback(self.callback)

    def _session(self) -> TrainingSession:
        if self.session is None:
            raise ConfigError("the pack saves and loads only inside trainer.train()")
        return self.session

    def _checkpoint_folders(self) -> TrainerFolders:
        if self._folders is None:
            raise ConfigError("the pack saves and loads only inside trainer.train()")
        return self._folders

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this handle is closed; attach_trainer(trainer) again")


def same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def attach_trainer(
    trainer: Trainer, plugin: ResiliencePlugin | None = None, *, health: HealthConfig | None = None
) -> TrainerResilience:
    """Route ``trainer``'s checkpoints through the pack; call on every rank, after making the Trainer.

    Args:
        trainer: The Trainer (or a subclass: ``Seq2SeqTrainer``, TRL's trainers).
        plugin: Settings; default ``ResiliencePlugin()``, i.e. all from ``ACCELERATE_RESILIENCE_*``. ``local_root``
            defaults to ``<output_dir>/resilience``, ``keep_last`` to ``save_total_limit`` (at least 2; without
            one, every checkpoint is kept, as the Trainer keeps its folders), ``run_dir`` to ``output_dir``.
        health: Health-monitoring settings; giving them turns monitoring on (as ``plugin.health`` does with the
            defaults).
    """
    return TrainerResilience(trainer, plugin if plugin is not None else ResiliencePlugin(), health)
