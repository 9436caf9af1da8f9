"""When to re-apply a restored RNG state in a Lightning run (see :class:`PendingRNG`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PendingRNG:
    """RNG state loaded from a checkpoint, to be applied where the saved run stood.

    Mid-epoch, the saved run went on with its next training step, while a resumed run first builds its data
    loader iterator (which draws a seed from the global generator): the state is applied at the first batch.
    After an epoch's last step, the saved run went through validation and epoch-end hooks and then built the
    next epoch's iterators: the state is applied when training starts (before validation is redone), and
    the iterators' seed draws are replayed at the first batch.
    """

    state: dict[str, Any]
    at_epoch_start: bool
