"""What every rank must know of the others before a save stages anything.

A save pays one collective on the training thread, a max of a few integers, and every decision that needs the
other ranks shares it: whether to stop (a failure anywhere, state only a sick rank holds, trees that differ),
and whether to skip or wait (a previous save still busy somewhere). Every rank then raises, skips or waits alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from resilience.errors import CheckpointError


@dataclass(frozen=True)
class Agreement:
    """The ranks' decisions for one save, as one all-reduce (max) found them."""

    error: bool  # a background failure on some rank: every rank stops, so that none runs ahead
    busy: bool  # some rank's previous save still holds its buffers: every rank skips, or waits
    alone: bool  # part of the state is held only by ranks that abstain: the save stands down
    same_tree: bool  # every rank deals the same tree (the highest and the lowest fingerprint are one)

    @staticmethod
    def mine(*, error: bool, busy: bool, alone: bool, digest: int) -> list[int]:
        """This rank's values to reduce; the fingerprint goes negated too, so that the max also finds the lowest."""
        return [int(error), int(busy), int(alone), digest, -digest]

    @classmethod
    def from_reduced(cls, reduced: list[int]) -> Agreement:
        error, busy, alone, high, negated_low = reduced
        return cls(bool(error), bool(busy), bool(alone), high == -negated_low)

    def raise_if_stopped(self, step: int, errors: list[CheckpointError], alone: list[str], abstain: list[int]) -> None:
        """Raise what stops the save, the same on every rank: this rank's own error or chunk where it has one."""
        if self.alone:
            what = f" (e.g. {alone[0]!r} here)" if alone else ""
            raise CheckpointError(
                f"part of the state{what} is held only by rank(s) {abstain}, whose GPU must not be read "
                "(sharded state with no replica): the save stands down, and a resume uses the last commit",
                step=step,
            )
        if self.error:
            raise (
                errors[0]
                if errors
                else CheckpointError(
                    "A checkpoint failed on another rank (see that rank's log); stopping so no rank runs ahead",
                    step=step,
                )
            )
        if not self.same_tree:
            raise CheckpointError(
                "the ranks' shared states differ in their tensors (names, dtypes or shapes), so their shares would "
                "not cover the state: every rank must pass the same tree as state (what differs per rank belongs in "
                "rank_state)",
                step=step,
            )
