"""What an Accelerate job's checkpoint holds, split the way the engine stores it.

Shared (identical on every rank, each tensor written once by one rank): the models, optimizers, schedulers
and GradScaler the accelerator prepared. Per rank: the RNG streams, the data loaders' positions and the objects
registered with ``register_for_checkpointing``, whose state Accelerate saves from rank 0 only, losing whatever
differs per rank.

The trees hold the live tensors (``state_dict()`` aliases, not copies): the engine's staging is the one copy a
save makes, and a resume fills these same tensors in place. For models whose parameters are DTensors (FSDP2)
they come from DCP's state-dict API (what Accelerate's own FSDP2 save uses): DTensor shards, each optimizer's
state keyed by parameter name (a resharded load matches by name), and an optimizer that has not stepped yet
gets its state made first, so a resume has shards to fill rather than whole tensors on every rank.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from accelerate_resilience import compat
from resilience.checkpoint.tree import TAG, flatten
from resilience.errors import ConfigError, IncompatibleStateError


def training_state(accelerator: Accelerator) -> dict[str, Any]:
    """Models (unwrapped from DDP/compile, so keys do not depend on the launch), optimizers, schedulers, scaler."""
    models = _unwrapped(accelerator)
    if _sharded(models):
        pairs = _optimizer_pairs(accelerator, models)
        model_states = [get_model_state_dict(model) for model in models]
        optimizer_states = [get_optimizer_state_dict(model, optimizer) for model, optimizer in pairs]
    else:
        model_states = [model.state_dict() for model in models]
        optimizer_states = [optimizer.state_dict() for optimizer in compat.optimizers(accelerator)]
    return {
        "models": model_states,
        "optimizers": optimizer_states,
        "schedulers": [scheduler.state_dict() for scheduler in compat.schedulers(accelerator)],
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
    }


def load_target(accelerator: Accelerator) -> dict[str, Any]:
    """The tensors a load fills in place: the models', and with sharded (DTensor) parameters the optimizers' too,
    which DCP must reshard into this run's layout. Other optimizers' state is read as the checkpoint holds it and
    handed to ``optimizer.load_state_dict``, which takes a state with fewer entries (saved before the first step,
    or while some parameters were frozen), as Accelerate's own ``load_state`` does; models stay strict."""
    models = _unwrapped(accelerator)
    if _sharded(models):
        return training_state(accelerator)
    return {"models": [model.state_dict() for model in models]}


def sharded(accelerator: Accelerator) -> bool:
    """Whether the prepared models' parameters are DTensor shards (FSDP2)."""
    return _sharded(_unwrapped(accelerator))


def _unwrapped(accelerator: Accelerator) -> list[Any]:
    return [accelerator.unwrap_model(model, keep_torch_compile=False) for model in compat.models(accelerator)]


def _sharded(models: list[Any]) -> bool:
    """Whether the state is DTensor shards (FSDP2 shards the parameters it is given)."""
    return any(isinstance(p, DTensor) for model in models for p in model.parameters())


def _optimizer_pairs(accelerator: Accelerator, models: list[Any]) -> list[tuple[Any, Any]]:
    """Each (torch) optimizer with the model whose parameters it steps: the i-th prepared one, as Accelerate pairs
    them."""
    optimizers = compat.optimizers(accelerator)
    if len(optimizers) > len(models):
        raise ConfigError(
            f"{len(optimizers)} optimizers but {len(models)} models were prepared: with sharded (DTensor) "
            "parameters the i-th optimizer must step the i-th model's (as Accelerate's own FSDP2 save assumes)"
        )
    return [(model, optimizer.optimizer) for model, optimizer in zip(models, optimizers, strict=False)]


def load_training_state(accelerator: Accelerator, state: dict[str, Any], where: str) -> None:
    for kind, live in (
        ("models", compat.models(accelerator)),
        ("optimizers", compat.optimizers(accelerator)),
        ("schedulers", compat.schedulers(accelerator)),
    ):
        fix = "prepare the same models, optimizers and schedulers, in the same order, as the run that saved it"
        _same_count(where, state[kind], live, kind, fix)
    models = _unwrapped(accelerator)
    if _sharded(models):  # model and optimizer separately: together, non-zero ranks can hang (notes/dcp.md)
        for model, saved in zip(models, state["models"], strict=True):
            set_model_state_dict(model, saved)
        for (model, optimizer), saved in zip(_optimizer_pairs(accelerator, models), state["optimizers"], strict=True):
            set_optimizer_state_dict(model, optimizer, saved)
    else:
        for model, saved in zip(models, state["models"], strict=True):
            model.load_state_dict(saved)
        for optimizer, saved in zip(compat.optimizers(accelerator), state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
    for scheduler, saved in zip(compat.schedulers(accelerator), state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])


def object_states(accelerator: Accelerator) -> list[Any]:
    return [obj.state_dict() for obj in compat.registered_objects(accelerator)]


def refuse_pickles(accelerator: Accelerator, states: list[Any]) -> None:
    """Refuse, at the save, a registered object's state that only pickle can store (with ``allow_pickle`` off).

    Its load would be refused, as a pickle runs code when loaded, and the run would learn it only at a resume,
    with the object left as it was. Accelerate's own save pickles such state; here the user chooses.
    """
    for index, (obj, state) in enumerate(zip(compat.registered_objects(accelerator), states, strict=True)):
        flat = flatten(state)
        if flat.pickled:
            raise ConfigError(
                f"Object {index} registered for checkpointing ({type(obj).__name__}) returns from state_dict() a "
                f"{_first_pickled_type(flat.skeleton)} at {flat.pickled[0]!r}, which only pickle can store, and a "
                "pickle runs code when it is loaded. Return plain values there (numbers, strings, lists, dicts, "
                "tensors, dates and times), or set ResiliencePlugin(allow_pickle=True) if only you can write to the "
                "checkpoint storage"
            )


def _first_pickled_type(skeleton: Any) -> str:
    """The type of the first value :func:`flatten` pickled, as its skeleton names it."""
    nodes = [skeleton]
    while nodes:
        node = nodes.pop(0)
        if isinstance(node, dict) and node.get(TAG) == "pickle":
            return str(node.get("type"))
        nodes.extend(node if isinstance(node, list) else node.values() if isinstance(node, dict) else [])
    return "value"


def load_object_states(accelerator: Accelerator, states: list[Any], where: str) -> None:
    objects = compat.registered_objects(accelerator)
    what, fix = "objects registered for checkpointing", "register the same objects, in the same order"
    _same_count(where, states, objects, what, fix, did="registered")
    for obj, saved in zip(objects, states, strict=True):
        obj.load_state_dict(saved)


def loader_states(accelerator: Accelerator) -> list[dict[str, Any]]:
    """Per rank: each prepared loader's epoch, StatefulDataLoader cursor and shuffle seed (Accelerate saves no
    epoch, so a resumed run would replay epoch 0's order)."""
    states = []
    for loader in compat.dataloaders(accelerator):
        sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
        states.append(
            {
                "epoch": compat.epoch(loader),
                "state": loader.state_dict() if compat.stateful(loader) else None,
                # SeedableRandomSampler shuffles epoch e with initial_seed + e: keep the seed, so a relaunch
                # that seeds torch differently still replays the same order.
                "seed": getattr(sampler, "initial_seed", None),
            }
        )
    return states


def load_loader_states(accelerator: Accelerator, states: list[dict[str, Any]], where: str) -> None:
    loaders = compat.dataloaders(accelerator)
    _same_count(where, states, loaders, "data loaders", "prepare the same data loaders, in the same order")
    for loader, saved in zip(loaders, states, strict=True):
        sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
        if saved["seed"] is not None and sampler is not None and hasattr(sampler, "initial_seed"):
            sampler.initial_seed = saved["seed"]
        if saved["state"] is not None and compat.stateful(loader):
            loader.load_state_dict(saved["state"])
            # the iterator's seed draws happen before the RNG is restored, as they did in the run that saved it
            # (a finished state makes torchdata draw for a second, fresh iterator)
            compat.refresh_snapshot(loader)
        compat.set_epoch(loader, saved["epoch"])


def _same_count(where: str, saved: list[Any], live: list[Any], what: str, fix: str, did: str = "prepared") -> None:
    """Saved and live states are matched by position: another count means another job's checkpoint."""
    if len(saved) != len(live):
        raise IncompatibleStateError(f"{where} holds {len(saved)} {what} but this run {did} {len(live)}: {fix}")
