"""When to re-apply a restored RNG state in a Lightning run (see :class:`PendingRNG`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PendingRNG:
    """RNG state loaded from a checkpoint, to be applied where the saved run stood.

    A save at the end of a step is followed, in the saved run, by the next training step, or at the end of an
    epoch by the next epoch's data loader iterator, which draws its shuffle seed from the global generator.
    A resumed run creates its iterator before its first step, so mid-epoch the state must be applied after
    that iterator exists, and at an epoch end before. Mid-epoch, ``epoch_start_state`` (the state as the
    saved run created that epoch's iterator) is applied before the iterator is created, so a sampler seeded
    from the global generator replays the same order.
    """

    state: dict[str, Any]
    at_epoch_start: bool
    epoch_start_state: dict[str, Any] | None = None
