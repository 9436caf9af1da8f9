"""What an Accelerate job's checkpoint holds, split the way the engine stores it.

Shared (identical on every rank, each tensor written once by one rank): the models, optimizers, schedulers
and GradScaler the accelerator prepared. Per rank: the RNG streams and the objects registered with
``register_for_checkpointing``, whose state Accelerate saves from rank 0 only, losing whatever differs per rank.

The trees hold the live tensors (``state_dict()`` aliases, not copies): the engine's staging is the one copy a
save makes, and a resume fills these same tensors in place.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from accelerate_resilience import compat
from resilience.errors import IncompatibleStateError


def training_state(accelerator: Accelerator) -> dict[str, Any]:
    """Models (unwrapped from DDP/compile, so keys do not depend on the launch), optimizers, schedulers, scaler."""
    return {
        "models": [
            accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()
            for model in compat.models(accelerator)
        ],
        "optimizers": [optimizer.state_dict() for optimizer in compat.optimizers(accelerator)],
        "schedulers": [scheduler.state_dict() for scheduler in compat.schedulers(accelerator)],
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
    }


def load_training_state(accelerator: Accelerator, state: dict[str, Any], where: str) -> None:
    for kind, live in (
        ("models", compat.models(accelerator)),
        ("optimizers", compat.optimizers(accelerator)),
        ("schedulers", compat.schedulers(accelerator)),
    ):
        if len(state[kind]) != len(live):
            raise IncompatibleStateError(
                f"{where} holds {len(state[kind])} {kind} but this run prepared {len(live)}: prepare the same "
                "models, optimizers and schedulers, in the same order, as the run that saved it"
            )
    for model, saved in zip(compat.models(accelerator), state["models"], strict=True):
        accelerator.unwrap_model(model, keep_torch_compile=False).load_state_dict(saved)
    for optimizer, saved in zip(compat.optimizers(accelerator), state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(compat.schedulers(accelerator), state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])


def object_states(accelerator: Accelerator) -> list[Any]:
    return [obj.state_dict() for obj in compat.registered_objects(accelerator)]


def load_object_states(accelerator: Accelerator, states: list[Any], where: str) -> None:
    objects = compat.registered_objects(accelerator)
    if len(states) != len(objects):
        raise IncompatibleStateError(
            f"{where} holds {len(states)} objects registered for checkpointing but this run registered "
            f"{len(objects)}: register the same objects, in the same order"
        )
    for obj, saved in zip(objects, states, strict=True):
        obj.load_state_dict(saved)
