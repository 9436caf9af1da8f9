"""The training session's part in a lost peer: the watch, the rescues from side threads, and the loss's record.

A rescue starts from the training thread (a collective failed), from the hang watchdog's thread (a collective
never returned) or from another survivor's notice; :class:`~resilience.recovery.peer_loss.PeerLossWatch` decides
who is lost and makes the survivor save; this records it once and leaves the process, or under
``resilience launch`` hands the training thread back to the restart in place.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from resilience.recovery import inplace
from resilience.recovery.liveness import Notice
from resilience.recovery.peer_loss import BoundaryBuilder, PeerLossConfig, PeerLossWatch
from resilience.recovery.survivors import SurvivorOutcome

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)
_SAID_OFF = threading.Event()  # this process said that survivor saves are off
UNWIND_S = 10.0  # how long a rescued training thread may take to leave its collective before the process goes
EXIT_STUCK = 1  # a process that left a collective it could not get out of: a lost rank, to the launcher


class SessionPeerLoss:
    """The training session's part in a lost peer: the watch (from :meth:`start`, when configured and possible),
    the rescues from side threads (a hang, another survivor's notice) and from the training thread (a failed
    collective), and the record of the loss, once.

    Args:
        manager: The engine the watch works with.
        boundary: Snapshots the state at each boundary.
        record: Writes the loss to the goodput ledger, called once with the outcome, the fault's words and the
            incarnation's end reason (the process exits, or restarts in place, right after).
        last_step: The session's last boundary (a hang rescue gives up once training moves on).
        over: Whether the session ended (no rescue starts then).
        is_main: Whether this process says why survivor saves are off.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        boundary: BoundaryBuilder,
        *,
        record: Callable[[SurvivorOutcome, str, str], None],
        last_step: Callable[[], int | None],
        over: Callable[[], bool],
        is_main: bool,
    ) -> None:
        self._manager = manager
        self._boundary = boundary
        self._record_loss = record
        self._last_step = last_step
        self._over = over
        self._is_main = is_main
        self.config: PeerLossConfig | None = None
        self.watch: PeerLossWatch | None = None
        self.recorded = False
        self._recording = threading.Lock()  # the rescue and the training thread may both report it: once

    def use(self, config: PeerLossConfig) -> None:
        """Survivor saves when a rank dies or hangs (effective from :meth:`start`, with a shared local tier)."""
        self.config = config

    def start(self) -> None:
        config, manager = self.config, self._manager
        if config is None or not config.enabled or manager.world_size <= 1:
            return
        if manager.local_shared or inplace.nodes() > 1:
            self.watch = PeerLossWatch(manager, config, self._boundary, on_notice=self._notice)
        if inplace.nodes() > 1:
            inplace.store()  # connected now: a node cut off later must not try to connect in the middle of a rescue
        if not manager.local_shared and self._is_main and not _SAID_OFF.is_set():  # once a process: same tiers
            _SAID_OFF.set()
            log.warning(
                "survivor saves of a lost rank need a local tier every rank sees (local_shared); with node-local "
                "disks %s",
                "they are made only for a node lost whole or cut off, by the survivors on one node"
                if self.watch is not None
                else "they are off for this run",
            )

    def at_boundary(self, step: int) -> None:
        if self.watch is not None:
            self.watch.at_boundary(step)

    def rescuing(self) -> bool:
        """Whether a survivor save is under way or done (its rescue leaves the process by itself)."""
        watch = self.watch
        return watch is not None and (watch.outcome is not None or watch.rescue_started)

    def hang_seen(self) -> None:
        """From the watchdog's thread: a hang may be a lost peer, which only a survivor save helps."""
        if self.watch is not None:
            threading.Thread(target=self._rescue_hang, name="resilience-hang-rescue", daemon=True).start()

    def _rescue_hang(self) -> None:
        """The training thread is stuck (in a collective with a stopped or vanished rank): save from here.

        A stopped rank's heartbeat goes stale only ``stale_s`` after its last beat, which may be later than the
        hang report: look again until then, and give up as soon as training moves on (a slow step, not a hang).
        """
        watch = self.watch
        assert watch is not None
        stuck_at = self._last_step()
        # several nodes under resilience launch: node 0 may declare a silent node lost later (node_lost_s)
        patience = float("inf") if inplace.nodes() > 1 else 2 * watch.config.stale_s
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline and self._last_step() == stuck_at and not self._over():
            if self._rescued(watch.after_failure(None)):
                return
            time.sleep(watch.config.heartbeat_s)

    def _notice(self, notice: Notice) -> None:
        """From the heartbeat thread: another survivor saves without the lost rank(s), and this rank must join,
        whatever its training thread is doing (under HSDP it may be blocked in a collective with that survivor,
        which would fail only once the survivor gives up)."""
        watch = self.watch
        if watch is None or self._over():
            return
        threading.Thread(
            target=lambda: self._rescued(watch.after_failure(None, notice)),
            name="resilience-notice-rescue",
            daemon=True,
        ).start()

    def _rescued(self, outcome: SurvivorOutcome | None) -> bool:
        """After a rescue from a side thread: record the survivor save and leave (the process exits; in place, the
        lost ranks are evicted and the training thread unwinds to the restart). False: nobody was lost."""
        if outcome is None:
            return False
        watch = self.watch
        assert watch is not None
        self._record()
        if inplace.active():
            # the training thread stays stuck in its collective until the lost ranks' processes are gone: the
            # launcher ends them, the collective fails, and the training thread unwinds to the restart; one held at
            # the optimizer step's gate is let go with an error
            inplace.evict(outcome.lost)
            watch.release()
            # ranks of a node declared lost cannot be ended from here (cut off): nothing will end the collective
            wait_s = 0.0 if set(outcome.lost) <= inplace.lost_node_ranks() else UNWIND_S
            # the timer holds the session weakly: a restart in place must find nothing of this generation left
            unstuck = threading.Timer(wait_s, _leave_if_stuck, args=(weakref.ref(self), outcome, wait_s))
            unstuck.daemon = True
            unstuck.start()
            return True
        watch.exit()
        return True

    def on_failure(self, error: BaseException) -> None:
        """``error`` left the training loop: if peers are lost, the survivors save and the process exits with the
        restart code; otherwise (and for an exit or Ctrl-C) nothing happens."""
        if self.watch is None or isinstance(error, (SystemExit, KeyboardInterrupt)):
            return
        if self.watch.after_failure(error) is not None:
            self._record()
            self.watch.exit()

    def _record(self) -> None:
        assert self.watch is not None and self.watch.outcome is not None
        outcome = self.watch.outcome
        what = f"rank(s) {outcome.lost} lost"
        state = "committed" if outcome.committed else f"not committed: {outcome.reason}"
        with self._recording:  # the second thread waits here until the first wrote it, then exits with it
            if self.recorded:
                return
            self.recorded = True
            then = "restarting in place" if inplace.active() else f"stopped, exit code {self.watch.config.exit_code}"
            self._record_loss(outcome, what, f"{then}: {what}; survivor save {state}")

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def _leave_if_stuck(peers: Callable[[], SessionPeerLoss | None], outcome: SurvivorOutcome, waited_s: float) -> None:
    """The training thread is still in its collective ``waited_s`` after the rescue: the lost ranks' processes were
    not ended (a node cut off, which nobody here can reach), and a gloo or NCCL call with a peer that never answers
    does not end. The process leaves, for the launcher to replace it. (Gone or over: the thread got out.)"""
    session = peers()
    if session is None or session._over():
        return
    log.error(
        "rank %d: stuck in a collective with the lost rank(s) %s %.0f s after the %s: leaving the process for the "
        "launcher to replace",
        session._manager.rank,
        outcome.lost,
        waited_s,
        outcome.describe(),
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STUCK)
