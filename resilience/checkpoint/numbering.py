"""The numbers a job's checkpoints take: the optimizer steps, moved past the last save when needed.

For adapters whose user calls the save (Accelerate's ``save_state()``, Fabric's ``fabric.save()``): every such
save must keep the state as it is at the call. The engine never overwrites a committed number and resumes the
highest, so each save needs a number above every earlier one. Numbering by optimizer steps alone gives one number
to every save between two steps (or to all of them, when no optimizer is known): a later call could then only be
answered with the earlier save, whose state is not the one at the call.

So a number is the optimizer steps plus ``ahead``: how far saves made between two optimizer steps moved the
numbering on. It grows with every optimizer step and with every save, so the newest checkpoint always has the
highest number, and the step boundaries (interval saves, health, survivor saves) that count in the same numbers
never land on a taken one. A resume takes both parts back from the checkpoint, so a restarted run goes on upward.
Without extra saves the numbers are the optimizer steps.
"""

from __future__ import annotations


class CheckpointNumbers:
    """Optimizer steps done, and the checkpoint number each save and step boundary takes."""

    def __init__(self) -> None:
        self.optimizer_steps = 0
        self.ahead = 0  # numbers taken by saves beyond one per optimizer step
        self.last: int | None = None  # the highest number saved or loaded

    @property
    def current(self) -> int:
        """The number of the present step boundary."""
        return self.optimizer_steps + self.ahead

    def for_save(self) -> int:
        """The number for a save now: the current one, or one past the last save when that one took it."""
        if self.last is not None and self.current <= self.last:
            self.ahead += self.last + 1 - self.current
        return self.current

    def saved(self, number: int) -> None:
        """A save took ``number`` (the caller's own, too): later boundaries and saves number above it."""
        self.last = number if self.last is None else max(self.last, number)
        self.ahead = max(self.ahead, number - self.optimizer_steps)

    def restored(self, number: int, optimizer_steps: int) -> None:
        """Checkpoint ``number``, taken after ``optimizer_steps`` steps, was loaded: numbering goes on from it."""
        self.optimizer_steps = optimizer_steps
        self.ahead = max(0, number - optimizer_steps)
        self.last = number
