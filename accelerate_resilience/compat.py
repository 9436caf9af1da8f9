"""Every use of Accelerate's private attributes, in one place, with the versions it was checked against.

Accelerate keeps what it prepared in private lists and gives its prepared data loader no public per-batch
hook, so the adapter reads those lists and wraps three of the loader's methods. Checked against accelerate
1.15.0 (the version the tests run) and, for the names below, present since 1.3 (the lowest version this
package states, because of ``unwrap_model(keep_torch_compile=...)``). If a release renames one of them, this
module is the only place to change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderShard
from accelerate.state import AcceleratorState, GradientState

from resilience.recovery import (
    inplace,  # ---- what the accelerator prepared (Accelerator._models, ._optimizers, ._schedulers, ._dataloaders,
)

# ._custom_objects: lists filled by prepare() and register_for_checkpointing()) --------------------------------


def models(accelerator: Accelerator) -> list[torch.nn.Module]:
    return list(accelerator._models)


def optimizers(accelerator: Accelerator) -> list[Any]:
    return list(accelerator._optimizers)


def schedulers(accelerator: Accelerator) -> list[Any]:
    return list(accelerator._schedulers)


def dataloaders(accelerator: Accelerator) -> list[Any]:
    return list(accelerator._dataloaders)


def registered_objects(accelerator: Accelerator) -> list[Any]:
    return list(accelerator._custom_objects)


def is_fsdp2(accelerator: Accelerator) -> bool:
    """``Accelerator.is_fsdp2`` (1.6+; before it, FSDP means FSDP1, which has no such attribute)."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def has_save_state_hooks(accelerator: Accelerator) -> bool:
    """Whether ``register_save_state_pre_hook`` was used (``Accelerator._save_model_state_pre_hook``)."""
    return bool(accelerator._save_model_state_pre_hook)


def forget_state() -> None:
    """Accelerate's process-wide singletons (``AcceleratorState``, ``PartialState``, ``GradientState``: shared
    ``_shared_state`` dicts, cleared by their private ``_reset_state``) describe a process group: a script run
    again in place (:mod:`resilience.recovery.inplace`) must make them anew over the next generation's group."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


inplace.before_next_generation(forget_state)


# ---- the prepared training loader (DataLoaderShard): as a module, the engine's
# resilience.checkpoint.position.LoaderAccess


def reports_batches(loader: Any) -> bool:
    """Only ``DataLoaderShard`` calls ``_update_state_dict`` per batch; ``DataLoaderDispatcher`` does not."""
    return issubclass(type(loader), DataLoaderShard)


class Replaced:
    """One object's method, replaced in that object's ``__dict__`` by a call to ``function``.

    Accelerate pickles its Accelerator and prepared loaders on purpose (``DataLoaderShard.__reduce__``). A pickled
    or copied object is one the handle does not watch, so this pickles as the method it replaced, bound to the
    copy: a closure, or the handle with its threads and locks, cannot be pickled.
    """

    def __init__(self, owner: Any, name: str, function: Callable[..., Any]):
        self.owner, self.name, self.function = owner, name, function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _own_method, (self.owner, self.name)


def _own_method(owner: Any, name: str) -> Any:
    """``owner``'s method ``name`` as its class defines it (what a pickled :class:`Replaced` comes back as)."""
    return getattr(type(owner), name).__get__(owner)


def replace(owner: Any, name: str, function: Callable[..., Any]) -> None:
    """``owner.name`` calls ``function`` until :func:`put_back`."""
    owner.__dict__[name] = Replaced(owner, name, function)


def put_back(owner: Any, *names: str) -> None:
    for name in names:
        if isinstance(owner.__dict__.get(name), Replaced):
            del owner.__dict__[name]


def replaced(owner: Any, name: str) -> Callable[..., Any] | None:
    """The function ``owner.name`` calls in place of its own, if replaced."""
    method = owner.__dict__.get(name)
    return method.function if isinstance(method, Replaced) else None


def hook(
    loader: Any, on_begin: Callable[[], None], on_batch: Callable[[], None], on_end: Callable[[], None] | None = None
) -> Callable[[], None]:
    """Call ``on_begin`` when a pass over ``loader`` starts, ``on_batch`` before each batch is handed out and
    ``on_end`` once the pass ends (:class:`resilience.checkpoint.position.LoaderAccess`).

    ``DataLoaderShard.begin()`` opens a pass, ``_update_state_dict()`` runs once per batch just before the yield
    (it snapshots a StatefulDataLoader's cursor there) and ``end()`` closes the pass. Returns the undo.
    """
    original_begin, original_update, original_end = loader.begin, loader._update_state_dict, loader.end

    def begin() -> None:
        original_begin()
        on_begin()

    def update_state_dict() -> None:
        on_batch()  # before Accelerate's snapshot: a save here records the cursor of the batches trained on
        original_update()

    def end() -> None:
        original_end()
        if on_end is not None:
            on_end()

    replace(loader, "begin", begin)
    replace(loader, "_update_state_dict", update_state_dict)
    replace(loader, "end", end)
    return lambda: put_back(loader, "begin", "_update_state_dict", "end")


def epoch(loader: Any) -> int:
    """Accelerate's epoch counter (``DataLoaderShard.iteration``: it drives ``set_epoch`` and the shuffle)."""
    return int(getattr(loader, "iteration", 0))


def set_epoch(loader: Any, value: int) -> None:
    if hasattr(loader, "iteration"):
        loader.iteration = value


def at_end(loader: Any) -> bool:
    return bool(loader.end_of_dataloader)


def stateful(loader: Any) -> bool:
    return bool(getattr(loader, "use_stateful_dataloader", False))


def skipped_in_sampler(loader: Any) -> int:
    """Batches a map-style loader made by ``skip_first_batches`` skips in its sampler, never reporting them."""
    return int(getattr(loader, "skip_batches", 0))


def shuffles_unseeded(loader: Any) -> bool:
    """A shuffled loader without a seedable sampler (``synchronized_generator``): its order cannot be replayed."""
    return getattr(loader, "synchronized_generator", None) is not None


def dataloader_of(loader: Any) -> Any:
    """The torch DataLoader inside a prepared one (its settings, its collate_fn)."""
    return getattr(loader, "base_dataloader", loader)


def refresh_snapshot(loader: Any) -> None:
    """After ``load_state_dict``, Accelerate's snapshot (``dl_state_dict``) is stale until the next batch:
    renew it, which also makes the iterator from the loaded state now, before the RNG is restored."""
    loader.dl_state_dict = loader.base_dataloader.state_dict()
