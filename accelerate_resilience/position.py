"""Where the training data stands, so that a resume draws the batch an uninterrupted run would draw next.

Accelerate's prepared loader (``DataLoaderShard``) calls ``begin()`` when a pass over the data starts and
``_update_state_dict()`` once per batch, just before handing the batch out (that is how it snapshots a
StatefulDataLoader's cursor). Wrapping those two calls on the training loader's instance gives a per-batch hook
without changing the user's loop: it counts batches per epoch, and lets the handle restore the RNG at the
moment it was saved and run interval saves at a point where the previous step is complete.

The epoch is Accelerate's own counter (``DataLoaderShard.iteration``, which drives ``set_epoch`` and so the
shuffle order); Accelerate does not save it, so a resumed run used to replay epoch 0's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from accelerate_resilience import compat
from resilience.errors import CheckpointError, IncompatibleStateError


@dataclass(frozen=True)
class Position:
    """The next batch to train on, and when the RNG saved with it applies.

    ``rng_at_next_batch``: the RNG was saved mid-epoch, with the loader's iterator already created (which
    draws seeds from the global RNG), so it is restored when the next batch is handed out; otherwise (between
    epochs) it is restored at once, before the next epoch's iterator draws its seeds.
    """

    epoch: int
    batch_in_epoch: int
    rng_at_next_batch: bool


class DataTracker:
    """Counts the batches of the training loader (and of loaders skipped ahead from it) per epoch.

    Args:
        loader: The prepared training ``DataLoaderShard``.
        on_batch: Called just before each batch is handed out, when the previous step is complete.
    """

    def __init__(self, loader: Any, on_batch: Callable[[], None]):
        self.loader = loader
        self.on_batch = on_batch
        self.epoch: int = compat.epoch(loader)
        self.batches = 0
        self.finished = False
        self.in_batch = False
        self.resume_offset: int | None = None
        self._undo: list[Callable[[], None]] = []
        self._follow(loader, self._take_resume_offset)

    @property
    def stateful(self) -> bool:
        return compat.stateful(self.loader)

    def position(self) -> Position:
        if self.finished:
            return Position(self.epoch + 1, 0, rng_at_next_batch=False)
        return Position(self.epoch, self.batches, rng_at_next_batch=self.in_batch or self.batches > 0)

    def resume_at(self, epoch: int, batch_in_epoch: int, *, positioned: bool) -> None:
        """Continue counting from a checkpoint; ``positioned``: the loader itself resumes mid-epoch (stateful)."""
        compat.set_epoch(self.loader, epoch)
        self.epoch, self.batches, self.finished = epoch, batch_in_epoch, False
        self.resume_offset = batch_in_epoch if positioned else None

    def follow_skip(self, child: Any, num_batches: int) -> None:
        """Track a loader that ``accelerator.skip_first_batches`` made from the training loader.

        It carries on the same epoch; once it is exhausted, the training loader's own epoch counter moves past
        it, so the next ``for batch in train_dl`` shuffles for the next epoch instead of replaying this one.
        """
        if self.resume_offset:
            raise CheckpointError(
                f"The StatefulDataLoader already continues at batch {self.resume_offset} of epoch {self.epoch}; "
                f"skipping {num_batches} more would drop data: pass ResumePoint.batches_to_skip (0 here)"
            )
        # A map-style child skips in its sampler (it never reports the skipped batches); an iterable one
        # reads and drops them, reporting each.
        skipped = num_batches - compat.skipped_in_sampler(child)
        self._follow(child, lambda: skipped)

        def after_end() -> None:
            compat.set_epoch(self.loader, max(compat.epoch(self.loader), compat.epoch(child)))

        self._undo.append(compat.hook_end(child, after_end))

    def detach(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()

    def _take_resume_offset(self) -> int:
        offset, self.resume_offset = self.resume_offset or 0, None
        return offset

    def _follow(self, loader: Any, first_batch: Callable[[], int]) -> None:
        def begin() -> None:
            self.epoch, self.batches, self.finished = compat.epoch(loader), first_batch(), False

        def batch() -> None:
            # runs before Accelerate snapshots the loader, so a save made here records the cursor of the batches
            # already trained on, matching self.batches
            self.in_batch = True
            try:
                self.on_batch()
            finally:
                self.in_batch = False
            self.batches += 1
            self.finished = compat.at_end(loader)

        self._undo.append(compat.hook_batches(loader, begin, batch))


def loader_states(loaders: Sequence[Any]) -> list[dict[str, Any]]:
    """Per rank: each prepared loader's epoch, StatefulDataLoader cursor and shuffle seed."""
    states = []
    for loader in loaders:
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


def load_loader_states(loaders: Sequence[Any], states: list[dict[str, Any]], where: str) -> None:
    if len(states) != len(loaders):
        raise IncompatibleStateError(
            f"{where} holds {len(states)} data loaders but this run prepared {len(loaders)}: prepare the same "
            "data loaders, in the same order"
        )
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
