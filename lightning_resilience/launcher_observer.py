"""Lightning's own launcher gives the pack's last saves their time.

When Lightning starts the ranks itself (``python train.py`` with ``devices=2``, no torchrun or SLURM), rank 0
runs a thread that polls the other ranks every 5 s and, as soon as one has exited with a non-zero code, SIGKILLs
every rank, rank 0 included, so that nobody waits forever in a collective with a dead peer. Two exits the pack
handles look alike to it:

* a rank lost whole (kill -9, an exception): the survivors are finding the loss and making a survivor save;
* a stop every rank agreed on (a preemption, a sick GPU): a rank that finished its part first exits with the
  stop's code while rank 0 is still leaving.

Killed then, the survivor save is lost, or rank 0, the process the user started, ends with -9 (137 to a
scheduler) instead of the code that asks for a requeue. Here the observer first waits as long as the pack's own
timers allow (the survivor save's grace, the stop's exit timeout), then does what it did: by then the process has
left by itself, unless the pack's own way out failed. Lightning's observer is private; if its shape changes, it is
left as it is and a warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from resilience.session import TrainingSession

log = logging.getLogger("resilience.lightning_launcher")  # the engine's logger: its lines go where the pack's go


@dataclass(frozen=True)
class LeaveTimes:
    """How long rank 0 may still need to leave by itself once another rank has exited.

    Attributes:
        stop_codes: The codes ranks exit with after a stop or a survivor save: rank 0 is leaving too.
        stop_s: After one of those: the stop's save and its exit's timers.
        lost_s: After any other exit, while survivor saves watch: the loss found, the save, the exit.
    """

    stop_codes: frozenset[int]
    stop_s: float
    lost_s: float

    def wait_s(self, code: int, watching: bool) -> float:
        if code in self.stop_codes:
            return self.stop_s
        return self.lost_s if watching else 0.0


def leave_times(session: TrainingSession) -> LeaveTimes:
    """The session's exit codes and timers (survivor saves and health stops, as configured)."""
    codes: set[int] = set()
    stop_s = lost_s = 0.0
    peers = session.peers.config
    if peers is not None and peers.enabled:
        codes.add(peers.exit_code)
        stop_s = lost_s = peers.rescue_s
    guard = session.health.guard
    if guard is not None:
        codes.update((guard.config.exit_code_preempted, guard.config.exit_code_gpu_fault))
        stop_s = max(stop_s, guard.config.grace_s)  # a decided stop's process is gone by then
    return LeaveTimes(frozenset(codes), stop_s, lost_s)


def defer_lightning_kills(session: TrainingSession) -> None:
    """Make Lightning's child-process observer of this process (if Lightning started the ranks from it) wait for
    ``session``'s last save and exit before it kills every rank. Call once training has started (the survivors'
    watch runs from then on); a later session takes the place of an earlier one."""
    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:  # moved in another Lightning: nothing here starts one
        return
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            _defer(thread, session)


def _defer(observer: threading.Thread, session: TrainingSession) -> None:
    kill = getattr(observer, "_resilience_kill", None) or getattr(observer, "_terminate_all", None)
    children = getattr(observer, "_child_processes", None)
    if not callable(kill) or not isinstance(children, list):
        log.warning(
            "Lightning's child-process observer has changed shape: when a rank exits, it may kill the others "
            "before their survivor save or stop is done (run under torchrun or `resilience launch` to avoid it)"
        )
        return
    times = leave_times(session)
    ref = weakref.ref(session)  # the plugin holds the session while it runs; an ended one watches nothing

    def watching() -> bool:
        live = ref()
        return live is not None and live.peer_watch is not None and not live.ended

    observer._resilience_kill = kill  # type: ignore[attr-defined]
    observer._terminate_all = _later(kill, children, times, watching)  # type: ignore[attr-defined]


def _later(
    kill: Callable[[], None], children: list, times: LeaveTimes, watching: Callable[[], bool]
) -> Callable[[], None]:
    def terminate_all() -> None:
        ended = [(local, proc.returncode) for local, proc in enumerate(children, start=1) if proc.returncode]
        wait = max((times.wait_s(code, watching()) for _, code in ended), default=0.0)
        if wait > 0:
            said = ", ".join(f"local rank {local} {_how(code)}" for local, code in ended)
            log.warning(
                "%s: Lightning's launcher ends the other ranks in %.0f s if they are still running, "
                "after their survivor save or stop",
                said,
                wait,
            )
            time.sleep(wait)
        kill()

    return terminate_all


def _how(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
