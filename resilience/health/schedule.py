"""Which step boundaries run the health agreement, so that its all-reduce costs little whatever the step time.

The agreement is one gloo all-reduce, a millisecond or more (3 ms between two processes on a busy 2-core machine,
more across many nodes). Against a training step of a second that is nothing; against a small model's 2 ms step it
more than doubled the loop. With ``check_every_n_steps="auto"`` the ranks agree, in the same all-reduce, how many
steps pass before the next one: each proposes enough steps that the check costs about :data:`SHARE` of its steps'
time, but no more than :data:`MAX_GAP_S` of steps at the pace it just saw, and the smallest proposal wins. So a
fault or a stop signal waits at most about that long for the agreement, and every rank checks at the same
boundaries without another message. Planned drills are checked at the step they name, so a drill stops the job
at the step its syntax says. In one process there is nothing to agree with, and every boundary is checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

SHARE = 0.01  # of the time of the steps between two checks, spent in the check
MAX_GAP_S = 2.0  # at most this much of steps (at the recent pace) between two checks
MAX_STEPS = 1000  # nor more steps than this, whatever the pace


class CheckSchedule:
    """The boundaries the health agreement runs at: multiples of a fixed ``every``, or agreed as it goes.

    Args:
        every: ``check_every_n_steps``: a number of steps, or ``"auto"``.
        planned: Steps of planned fault drills (every rank's: the plan is the same on all); with ``"auto"`` each
            is checked.
        alone: One process: nothing to agree with; with ``"auto"`` every boundary is checked.
    """

    def __init__(self, every: int | Literal["auto"], planned: Iterable[int] = (), *, alone: bool = False):
        self.every = every
        self.alone = alone
        self.planned = sorted(set(planned))
        self.next: int | None = None  # "auto": the agreed step of the next check; None: the next boundary
        self.cost_s: float | None = None  # of the last check, as this rank waited for it
        self._last: tuple[int, float] | None = None  # the last check's step and time

    def due(self, step: int) -> bool:
        """Whether the boundary of ``step`` runs the agreement (the same answer on every rank)."""
        if self.every != "auto":
            return step % self.every == 0
        drill = False
        while self.planned and self.planned[0] <= step:
            self.planned.pop(0)
            drill = True
        return drill or self.alone or self.next is None or step >= self.next

    def proposal(self, step: int, now: float) -> int:
        """How many steps this rank would let pass before the next check (sent in the agreement)."""
        last, self._last = self._last, (step, now)
        if self.every != "auto" or last is None or self.cost_s is None or step <= last[0]:
            return 1
        pace_s = (now - last[1]) / (step - last[0])
        if pace_s <= 0:
            return 1
        wanted = math.ceil(self.cost_s / (SHARE * pace_s))
        return max(1, min(wanted, math.floor(MAX_GAP_S / pace_s), MAX_STEPS))

    def agreed(self, step: int, steps: int, cost_s: float) -> None:
        """The ranks agreed at ``step`` to check again ``steps`` later; this rank's check took ``cost_s``."""
        self.cost_s = cost_s
        self.next = step + max(1, steps)
