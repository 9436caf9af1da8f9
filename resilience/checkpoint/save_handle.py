"""What a save gives back: futures for its phases, in the shape of DCP's ``AsyncSaveResponse``.

A save returns once the state is being copied to host memory; the rest happens in the background. Each phase
that a caller may want to wait for is a :class:`concurrent.futures.Future`, resolved by the pipeline (with a
result, or with the error that ended the save), so waiting, polling and callbacks are the standard ones.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Commit:
    """A checkpoint that now counts in one tier: its manifest is written."""

    step: int
    tier: str
    path: str
    nbytes: int


@dataclass
class SaveHandle:
    """Progress of one save, as futures.

    Attributes:
        step: The checkpoint's step.
        staged: Resolved once the copy to host memory is done (the state may change from then on).
        committed: Resolved with the local :class:`Commit`, or with the error that failed the save.
        durable: Resolved with the durable :class:`Commit`; with None when there is no durable tier or a newer
            checkpoint superseded this one before its upload began; with the upload's error if it failed.
        timings: Seconds spent per phase (``block_s``, ``stage_wait_s``, ``write_s``, ``hash_s``, ``upload_s``),
            filled in as the phases end.
    """

    step: int
    staged: Future[None] = field(default_factory=Future)
    committed: Future[Commit] = field(default_factory=Future)
    durable: Future[Commit | None] = field(default_factory=Future)
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def done(cls, commit: Commit) -> SaveHandle:
        """A handle for a checkpoint that exists already (e.g. the one just restored): every phase ended."""
        handle = cls(commit.step)
        handle.staged.set_result(None)
        handle.committed.set_result(commit)
        handle.durable.set_result(None)
        return handle

    def fail(self, error: BaseException) -> None:
        """End every phase not yet ended with ``error`` (the pipeline's one way to give up on a save)."""
        for future in (self.staged, self.committed, self.durable):
            if not future.done():
                future.set_exception(error)


@dataclass
class SaveStats:
    """Counters a user or a metrics callback can read at any time.

    ``stall_s`` is every second the training thread spent in the manager's saves and waits (staging waits
    before an optimizer step included): what a save cost training, for the goodput ledger.
    """

    saves: int = 0
    skipped: int = 0
    waited_for_previous: int = 0
    block_s: list[float] = field(default_factory=list)
    staging_wait_s: float = 0.0
    stall_s: float = 0.0
