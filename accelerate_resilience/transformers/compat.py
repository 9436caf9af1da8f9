"""Every use of the Hugging Face Trainer's private names, in one place, with the version it was checked against.

The Trainer has no checkpoint plugin: its save (``_save_checkpoint``), its step boundary
(``_maybe_log_save_evaluate``) and two of its resume steps (``_load_from_checkpoint``, ``_load_rng_state``) are
private methods, and what it writes as ``trainer_state.json`` is built inside ``_save_checkpoint``. What its
``checkpoint-N`` folders hold beside that comes from ``_save`` and ``save_pretrained``'s internals. Checked against
transformers 5.25.0, the version the tests run, and 5.13, the lowest stated (``make test-floors``). If a release
renames one of them, this module is the only place to change.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import tempfile
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers import PreTrainedModel, Trainer, TrainerControl, TrainerState
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint
from transformers.training_args import ParallelMode
from transformers.utils.hub import convert_file_size_to_int

from resilience.errors import ConfigError

# The Trainer's methods the handle takes the place of (on the one instance), each falling back to the Trainer's own
# for what is not the pack's: a stock ``checkpoint-N`` folder still loads as before.
ROUTED = ("train", "_save_checkpoint", "_maybe_log_save_evaluate", "_load_from_checkpoint", "_load_rng_state")
# ``_load_best_model`` as well, where the Trainer tracks a best model
BEST_MODEL = "_load_best_model"
__all__ = ["TRAINER_STATE_NAME"]  # where the Trainer reads a checkpoint's state (its folder's one file it reads)
# the weight files of a save (save_pretrained's, its shards and index, a PEFT adapter's): a folder's come from the step
_WEIGHT_FILE = re.compile(r"(model|pytorch_model|adapter_model)([-.].*)?\.(safetensors|bin)(\.index\.json)?")
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


# ---- what a checkpoint-N folder holds, as the Trainer's own save writes it ------------------------------------------


def saved_weights(model: torch.nn.Module) -> list[list[str]]:
    """The weights the Trainer's save writes, as [name in the file, name in ``model.state_dict()``], in order.

    A ``PreTrainedModel`` is saved by ``save_pretrained``: without its ``_keys_to_ignore_on_save``, without the tied
    copies (``lm_head.weight`` beside the embedding), under the names its weight conversion reverts to. Any other
    model's whole state dict goes to ``model.safetensors``. Raises ConfigError where the folder could not hold what
    the Trainer writes: a PEFT adapter, a quantized model, or a conversion that computes new tensors.
    """
    state = model.state_dict()
    if not isinstance(model, PreTrainedModel):
        return [[name, name] for name in state]
    if getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "hf_quantizer", None) is not None:
        raise ConfigError("the Trainer saves this model's adapter or quantized weights in a format of its own")
    for ignored in model._keys_to_ignore_on_save or []:
        state.pop(ignored, None)
    kept = remove_tied_weights_from_state_dict(state, model)
    shapes = {name: torch.empty_like(value, device="meta") for name, value in kept.items()}
    source = {id(value): name for name, value in shapes.items()}
    reverted = revert_weight_conversion(model, dict(shapes))
    if any(id(value) not in source for value in reverted.values()):
        raise ConfigError("save_pretrained converts this model's weights into new tensors when it saves them")
    return [[name, source[id(value)]] for name, value in reverted.items()]


def max_shard_bytes(model: torch.nn.Module) -> int | None:
    """``save_pretrained``'s default shard size for a ``PreTrainedModel``; None (one file) for any other model."""
    if not isinstance(model, PreTrainedModel):
        return None
    return int(convert_file_size_to_int(inspect.signature(model.save_pretrained).parameters["max_shard_size"].default))


def side_files(trainer: Trainer) -> dict[str, bytes]:
    """What the Trainer's save writes beside the weights (``config.json``, ``generation_config.json``, the
    tokenizer's files, ``training_args.bin``): its own ``_save`` into a scratch folder with no weights, read back."""
    with tempfile.TemporaryDirectory(prefix="resilience-trainer-files-") as scratch:
        trainer._save(scratch, state_dict={})
        files = {}
        for name in sorted(os.listdir(scratch)):
            path = os.path.join(scratch, name)
            if os.path.isfile(path) and not _WEIGHT_FILE.fullmatch(name):
                with open(path, "rb") as stream:
                    files[name] = stream.read()
        return files


def rng_devices(trainer: Trainer) -> str | int | None:
    """Which CUDA RNG state ``Trainer._save_rng_state`` keeps: every device's under DDP ("all"), else the current
    device's (its index); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return "all" if trainer.args.parallel_mode == ParallelMode.DISTRIBUTED else torch.cuda.current_device()


def checkpoint_step(folder: str) -> int:
    """The global step of a checkpoint folder, from its ``trainer_state.json`` (0 when it has none)."""
    try:
        return int(TrainerState.load_from_json(os.path.join(folder, TRAINER_STATE_NAME)).global_step)
    except (OSError, ValueError, TypeError):
        return 0
