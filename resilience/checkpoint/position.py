"""Where the training data stands, so that a resume draws the batch an uninterrupted run would draw next.

An adapter whose user writes the training loop (Accelerate's) has no loop of its own to count batches in, but
the framework's prepared loader says when a pass over the data starts, when each batch is handed out and when
the pass ends. Hooked there, a :class:`DataTracker` counts batches per epoch without changing the user's loop,
and gives the adapter a per-batch point where the previous step is complete (interval saves happen there, and
an RNG saved mid-epoch is restored there). The epoch is the loader's own counter, the one that drives its
shuffle order; frameworks keep it where they like and do not save it (so a resumed run used to replay epoch 0's
order): the adapter reads, sets and hooks the loader through a :class:`LoaderAccess`, the one place that knows
the framework's loader. Nothing here imports a framework.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from resilience.errors import CheckpointError


class LoaderAccess(Protocol):
    """What a :class:`DataTracker` needs of a framework's prepared data loader (an adapter's compat module)."""

    def epoch(self, loader: Any) -> int:
        """The loader's epoch counter (it drives the shuffle order)."""

    def set_epoch(self, loader: Any, value: int) -> None: ...

    def at_end(self, loader: Any) -> bool:
        """Whether the batch being handed out is the pass's last."""

    def stateful(self, loader: Any) -> bool:
        """Whether the loader continues mid-epoch by itself once its saved state is loaded."""

    def skipped_in_sampler(self, loader: Any) -> int:
        """Batches a skipping loader leaves out without handing them to the hooks."""

    def hook(
        self,
        loader: Any,
        on_begin: Callable[[], None],
        on_batch: Callable[[], None],
        on_end: Callable[[], None] | None = None,
    ) -> Callable[[], None]:
        """Call ``on_begin`` when a pass starts, ``on_batch`` before each batch is handed out and ``on_end`` once
        the pass ended; returns the undo."""


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
        loader: The framework's prepared training loader.
        on_batch: Called just before each batch is handed out, when the previous step is complete.
        access: How to read, set and hook ``loader`` (the adapter's knowledge of its framework).
    """

    def __init__(self, loader: Any, on_batch: Callable[[], None], access: LoaderAccess):
        self.loader = loader
        self.on_batch = on_batch
        self.access = access
        self.epoch: int = access.epoch(loader)
        self.batches = 0
        self.finished = False
        self.in_batch = False
        self.resume_offset: int | None = None
        self._undo: list[Callable[[], None]] = []
        self._follow(loader, self._take_resume_offset)

    @property
    def stateful(self) -> bool:
        return self.access.stateful(self.loader)

    def position(self) -> Position:
        if self.finished:
            return Position(self.epoch + 1, 0, rng_at_next_batch=False)
        return Position(self.epoch, self.batches, rng_at_next_batch=self.in_batch or self.batches > 0)

    def resume_at(self, epoch: int, batch_in_epoch: int, *, positioned: bool) -> None:
        """Continue counting from a checkpoint; ``positioned``: the loader itself resumes mid-epoch (stateful)."""
        self.access.set_epoch(self.loader, epoch)
        self.epoch, self.batches, self.finished = epoch, batch_in_epoch, False
        self.resume_offset = batch_in_epoch if positioned else None

    def follow_skip(self, child: Any, num_batches: int) -> None:
        """Track a loader that skips the first ``num_batches`` of the training loader's epoch (Accelerate's
        ``skip_first_batches`` makes one).

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
        skipped = num_batches - self.access.skipped_in_sampler(child)

        def after_end() -> None:
            self.access.set_epoch(self.loader, max(self.access.epoch(self.loader), self.access.epoch(child)))

        self._follow(child, lambda: skipped, after_end)

    def detach(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()

    def _take_resume_offset(self) -> int:
        offset, self.resume_offset = self.resume_offset or 0, None
        return offset

    def _follow(self, loader: Any, first_batch: Callable[[], int], on_end: Callable[[], None] | None = None) -> None:
        def begin() -> None:
            self.epoch, self.batches, self.finished = self.access.epoch(loader), first_batch(), False

        def batch() -> None:
            # runs before the framework snapshots the loader's state, so a save made here records the cursor of
            # the batches already trained on, matching self.batches
            self.in_batch = True
            try:
                self.on_batch()
            finally:
                self.in_batch = False
            self.batches += 1
            self.finished = self.access.at_end(loader)

        self._undo.append(self.access.hook(loader, begin, batch, on_end))
