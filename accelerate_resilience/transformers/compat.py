"""Every use of the Hugging Face Trainer's private names, in one place, with the version it was checked against.

The Trainer has no checkpoint plugin: its save (``_save_checkpoint``), its step boundary
(``_maybe_log_save_evaluate``) and two of its resume steps (``_load_from_checkpoint``, ``_load_rng_state``) are
private methods, and what it writes as ``trainer_state.json`` is built inside ``_save_checkpoint``. Checked against
transformers 5.25.0, the version the tests run, and 5.13, the lowest stated (``make test-floors``). If a release
renames one of them, this module is the only place to change.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerControl, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint

from resilience.errors import ConfigError

# The Trainer's methods the handle takes the place of (on the one instance), each falling back to the Trainer's own
# for what is not the pack's: a stock ``checkpoint-N`` folder still loads as before.
ROUTED = ("train", "_save_checkpoint", "_maybe_log_save_evaluate", "_load_from_checkpoint", "_load_rng_state")
# ``_load_best_model`` as well, where the Trainer tracks a best model
BEST_MODEL = "_load_best_model"
__all__ = ["TRAINER_STATE_NAME"]  # where the Trainer reads a checkpoint's state (its folder's one file it reads)
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA, DistributedType.FSDP)


def refuse_unsupported(trainer: Trainer) -> None:
    """Set-ups whose checkpoints the pack cannot stand in for: say which, and what to do."""
    kind = trainer.accelerator.distributed_type
    if kind in _UNSUPPORTED:
        raise ConfigError(
            f"attach_trainer does not handle a Trainer under {kind}, whose engine keeps its state in a checkpoint "
            "format of its own: train with DDP or one process, or leave the Trainer's own checkpoints in place"
        )
    args = trainer.args
    if args.save_only_model:
        raise ConfigError(
            "TrainingArguments(save_only_model=True) keeps no optimizer, scheduler or RNG state, so no run could "
            "resume from it, and resuming is what the pack's checkpoints are for: leave save_only_model off, and "
            "write the weights alone after training with trainer.save_model()"
        )
    if args.push_to_hub:
        raise ConfigError(
            "TrainingArguments(push_to_hub=True) pushes the Trainer's checkpoint-N folders, which the pack does not "
            "write: leave push_to_hub off and call trainer.push_to_hub() after training"
        )


def trainer_state_json(trainer: Trainer) -> str:
    """What ``Trainer._save_checkpoint`` writes as ``trainer_state.json``, after doing what it does to the live
    state first: the states of the callbacks that export theirs (``ExportableState``, and the ``TrainerControl``)
    go into it, a duplicated callback's list growing by one entry per save, as in the Trainer. So the state in
    memory after a save is the one a resume from it comes back with. Plain JSON, never a pickle."""
    kept: dict[str, Any] = trainer.state.stateful_callbacks  # type: ignore[assignment]  # a dict once made
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, ExportableState):
            name = type(callback).__name__
            if isinstance(kept.get(name), list):
                kept[name].append(callback.state())
            else:
                kept[name] = callback.state()
    return json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True) + "\n"


def take_state(trainer: Trainer, text: str) -> None:
    """What ``Trainer.train`` takes from a checkpoint's ``trainer_state.json`` before its loop: the state, and
    with ``auto_find_batch_size`` the batch size the run had come down to (``Trainer._train_batch_size``)."""
    trainer.state = TrainerState(**json.loads(text))
    if trainer.state.train_batch_size is not None and trainer.args.auto_find_batch_size:
        trainer._train_batch_size = trainer.state.train_batch_size


def tracks_best(trainer: Trainer) -> bool:
    """Whether the Trainer names a best checkpoint at its saves (``best_global_step``, by its save strategy)."""
    strategies = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
    return trainer.args.save_strategy in strategies and bool(trainer.state.best_global_step)


def last_stock_checkpoint(trainer: Trainer) -> str | None:
    """The newest ``checkpoint-N`` folder the Trainer itself wrote in ``output_dir`` (a run before the pack)."""
    try:
        return get_last_checkpoint(output_dir(trainer))
    except FileNotFoundError:
        return None


def finished(trainer: Trainer, step: int) -> bool:
    """Whether ``step`` is the run's last (``max_steps``; with epochs instead, the Trainer's loop trains nothing)."""
    return 0 < trainer.args.max_steps <= step


def stock_step(name: str) -> int | None:
    """The step of a ``checkpoint-N`` folder name."""
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    number = name.removeprefix(prefix)
    return int(number) if name.startswith(prefix) and number.isdigit() else None


def stop_control(control: TrainerControl) -> None:
    """After an agreed stop: leave the training loop, with no evaluation or save left to run in its grace."""
    control.should_training_stop = True
    control.should_evaluate = False
    control.should_save = False


def model(trainer: Trainer) -> torch.nn.Module:
    """The Trainer's own model (``trainer.model``: never wrapped in DDP, whose wrapper is ``model_wrapped``)."""
    if trainer.model is None:
        raise ConfigError("the Trainer has no model: give it one (model= or model_init=) before attach_trainer")
    return trainer.model


def output_dir(trainer: Trainer) -> str:
    """``args.output_dir`` (the Trainer fills in ``trainer_output`` when it is left out)."""
    return str(trainer.args.output_dir)


def step_loop_objects(trainer: Trainer) -> dict[str, Any]:
    """What the Trainer made for the loop (``_prepare_for_training``): optimizer, scheduler and scaler."""
    return {
        "optimizer": trainer.optimizer,
        "scheduler": trainer.lr_scheduler,
        "scaler": getattr(trainer.accelerator, "scaler", None),
    }
