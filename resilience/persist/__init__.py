"""The background half of a save: DCP files written and hashed, committed, uploaded, in a helper process or threads.

Two pipelines do it, :class:`~resilience.persist.pipeline.Pipeline` (threads of the training process) and
:class:`~resilience.persist.helper.HelperPipeline` (a helper process per rank); the manager holds either as a
:class:`PersistPipeline`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from resilience.errors import CheckpointError
    from resilience.persist.pipeline import WriteJob


class Failures:
    """The failures a pipeline keeps for the next save to raise: recorded from its background threads, taken by
    the training thread, so every access holds the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[CheckpointError] = []

    def add(self, error: CheckpointError) -> None:
        with self._lock:
            self._kept.append(error)

    def kept_as(self, error: CheckpointError) -> CheckpointError:
        """The kept failure with ``error``'s message, else ``error``: a failure that crossed from the helper twice
        (kept, and failing its handle) is then one object, and raising it once also clears it."""
        with self._lock:
            return next((e for e in self._kept if str(e) == str(error)), error)

    def discard(self, error: BaseException) -> None:
        with self._lock:
            self._kept = [e for e in self._kept if e is not error]

    def take(self) -> list[CheckpointError]:
        with self._lock:
            kept, self._kept = self._kept, []
        return kept


class PersistPipeline(Protocol):
    """What the manager asks of the background half of saves, wherever it runs.

    Failures reach the manager two ways, and both must happen: the save's handle fails (whoever waits on it
    sees the error), and the error is kept for :meth:`take_errors` (so the next save raises it even if nobody
    waited), recorded before the handle wakes its waiter.
    """

    def submit(self, job: WriteJob) -> None:
        """Queue one save; returns at once. Saves are written in the order submitted; each resolves its handle's
        futures as it goes (staged, committed locally, then durably or skipped), or fails them."""

    def close(self, timeout: float | None = None) -> bool:
        """Finish what was submitted, then let what runs in the background end (the threads, or the helper
        process); False if that did not happen within ``timeout`` seconds: the work then goes on, unwaited."""

    def retain(self) -> None:
        """Apply retention as after a commit, with the protected steps as of now (after the saves already submitted,
        where those run in another process): what a commit's retention had to keep may go."""

    failures: Failures  # what both pipelines keep, and the two methods below read

    def discard_error(self, error: BaseException) -> None:
        """Forget ``error``, raised to the caller already (by its handle): the next save must not raise it again."""
        self.failures.discard(error)

    def take_errors(self) -> list[CheckpointError]:
        """The failures kept since the last call, oldest first; they are forgotten here."""
        return self.failures.take()
