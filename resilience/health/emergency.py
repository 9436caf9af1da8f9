"""A stop's emergency save and its one clock: from the fault, everything a stop does fits the grace period.

Schedulers give a stopped job a fixed time between SIGTERM and SIGKILL (SLURM's KillWait, Kubernetes'
terminationGracePeriodSeconds: 30 s by default), and a process killed by SIGKILL exits 137, which a requeue-on-75
recipe does not requeue. So a stop runs on one clock that starts at the fault: the emergency save commits locally,
its upload gets what is left of the grace but a reserve kept for leaving, and the process is gone by the end of
the grace, whatever storage does (an ``os._exit`` with the stop's code ends a teardown still held up by a hung
upload or a stuck collective). An upload cut short is done again by the next start.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopDeadline:
    """A stop's clock (wall-clock seconds, as faults are stamped): work until :attr:`work_ends`, out by
    :attr:`exit_at`."""

    fault_time: float
    grace_s: float
    reserve_s: float

    @property
    def exit_at(self) -> float:
        return self.fault_time + self.grace_s

    @property
    def work_ends(self) -> float:
        return self.exit_at - min(self.reserve_s, self.grace_s)

    def work_left(self) -> float:
        """Seconds left for the stop's saves and uploads."""
        return max(0.0, self.work_ends - time.time())

    def exit_left(self) -> float:
        """Seconds left before the process must be gone."""
        return max(0.0, self.exit_at - time.time())


@dataclass
class EmergencySave:
    """What an emergency save got committed, with times measured from the fault.

    ``durable_committed`` is None without a durable tier. ``already_saved``: the step had been saved
    before the fault (a regular save at the same step); that save was waited for instead.
    """

    step: int
    local_committed: bool = False
    durable_committed: bool | None = None
    already_saved: bool = False
    block_s: float | None = None
    fault_to_local_s: float | None = None
    fault_to_durable_s: float | None = None
    error: str | None = None


def emergency_save(
    manager: CheckpointManager,
    step: int,
    state: Any = None,
    rank_state: Any = None,
    *,
    grace_s: float,
    fault_time: float | None = None,
    save: Callable[[], object] | None = None,
) -> EmergencySave:
    """Save ``step`` and wait for it within ``grace_s`` seconds of ``fault_time`` (default: now). Collective.

    The local commit gets the time first; the durable commit gets what is left, and its upload goes on in the
    background after this returns (:meth:`HealthGuard.emergency_save` gives it until
    :attr:`StopDeadline.work_ends`; the next start uploads what it could not). Never raises for a failed save:
    the caller is about to stop either way, and the error is in the result (and the log). ``save``, if given,
    replaces ``manager.save(step, state, rank_state)``: a framework's own save of this step through the same
    manager (it builds the state).
    """
    start = time.time() if fault_time is None else fault_time

    def left() -> float:
        return max(0.0, start + grace_s - time.time())

    result = EmergencySave(step, durable_committed=False if manager.durable is not None else None)
    try:
        result.already_saved = manager.saved(step) is not None
        if save is not None:
            save()
        elif not result.already_saved:
            handle = manager.save(step, state, rank_state)
            if handle is None:  # the previous save was still being written and when_busy="skip"
                manager.wait(left())
                handle = manager.save(step, state, rank_state)
                if handle is None:
                    raise TimeoutError("the previous save did not finish in time, so this one was skipped")
            result.block_s = handle.timings.get("block_s")
        mine = manager.saved(step)
        if mine is None:
            raise TimeoutError(f"step {step} was not saved (the previous save was still being written)")
        result.local_committed = _done(mine.committed, left())
        if result.local_committed:
            result.fault_to_local_s = time.time() - start
            if manager.durable is not None:
                result.durable_committed = _done(mine.durable, left())
                if result.durable_committed:
                    result.fault_to_durable_s = time.time() - start
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    _log_emergency(manager.rank, result, grace_s)
    return result


def _done(future: concurrent.futures.Future[Any], timeout: float) -> bool:
    """Whether ``future`` ended with a commit within ``timeout`` (its error, if any, is raised)."""
    try:
        return future.result(timeout) is not None
    except concurrent.futures.TimeoutError:
        return False


def _log_emergency(rank: int, result: EmergencySave, grace_s: float) -> None:
    if not result.local_committed:
        log.error(
            "rank %d: emergency save of step %d not committed within %.1f s of the fault (%s); a restart "
            "resumes from the newest earlier checkpoint",
            rank,
            result.step,
            grace_s,
            result.error or "timed out",
        )
        return
    durable = {
        None: "no durable tier",
        True: f"durable after {result.fault_to_durable_s or 0:.1f} s",
        False: f"upload failed: {result.error}" if result.error else "upload still running",
    }[result.durable_committed]
    log.warning(
        "rank %d: emergency save of step %d committed locally %.1f s after the fault (%s)",
        rank,
        result.step,
        result.fault_to_local_s or 0.0,
        durable,
    )
