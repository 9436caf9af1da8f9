"""The session's part in a peer's death or hang: keep what a survivor save needs, and act when it comes.

At every step boundary this keeps a snapshot of the state as of that step (this rank's own part by value, the
shared part as live tensors that stay valid until the next optimizer step) and publishes this rank's own
part for the others (:mod:`resilience.liveness`). When a collective fails, or the hang watchdog fires while a
collective never returns, it asks the liveness records who is gone; if someone is, the survivors commit the
last boundary's step among themselves (:mod:`resilience.survivors`) and the process exits with a code the
launcher restarts on. A failure with every peer alive is not ours to handle: it propagates as it is.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from resilience import inplace
from resilience.errors import ConfigError
from resilience.liveness import Liveness
from resilience.survivors import SurvivorOutcome, survivor_save

if TYPE_CHECKING:
    from resilience.manager import CheckpointManager
    from resilience.session import SaveState

log = logging.getLogger(__name__)
LIVE_DIR = ".live"


@dataclass(frozen=True)
class BoundarySnapshot:
    """The state at one step boundary, for a save made later without the other ranks.

    Attributes:
        step: The optimizer steps done.
        rank_state: This rank's own state (RNG streams, data position), captured by value.
        shared: Builds the shared state when it is needed; its tensors are the live ones, which still hold this
            step's values as long as no optimizer step ran since.
    """

    step: int
    rank_state: Any
    shared: Callable[[], SaveState]


BoundaryBuilder = Callable[[int], BoundarySnapshot]


@dataclass
class PeerLossConfig:
    """What the survivors of a lost rank do.

    Attributes:
        enabled: When a rank dies or hangs, the healthy ranks commit the last completed step from their replicas
            and exit (needs a local tier every rank sees).
        stale_s: A rank whose heartbeat is older than this counts as lost (a stopped or unreachable process;
            a dead process on this host is seen at once). Keep it below the hang watchdog's ``hang_min_s``.
        heartbeat_s: How often each rank's heartbeat is touched.
        grace_s: Seconds the survivor save may take, from the failure.
        exit_code: What the survivors exit with afterwards (75: ``EX_TEMPFAIL``, "run it again").
    """

    enabled: bool = True
    stale_s: float = 5.0
    heartbeat_s: float = 1.0
    grace_s: float = 25.0
    exit_code: int = 75

    def __post_init__(self) -> None:
        if min(self.stale_s, self.heartbeat_s, self.grace_s) <= 0 or self.heartbeat_s >= self.stale_s:
            raise ConfigError(
                f"stale_s={self.stale_s}, heartbeat_s={self.heartbeat_s}, grace_s={self.grace_s}: need positive "
                "seconds and heartbeat_s < stale_s"
            )


class PeerLossWatch:
    """Boundary snapshots and the reaction to a lost peer, for one training session."""

    def __init__(self, manager: CheckpointManager, config: PeerLossConfig, boundary: BoundaryBuilder):
        self.manager = manager
        self.config = config
        self.boundary = boundary
        self.liveness = Liveness(
            os.path.join(manager.local.root, LIVE_DIR, manager.job_token),
            manager.rank,
            manager.world_size,
            interval_s=config.heartbeat_s,
        )
        self.snapshot: BoundarySnapshot | None = None
        self.outcome: SurvivorOutcome | None = None
        self._stepped = False
        self._rescuing = threading.Lock()
        self._hook = register_optimizer_step_post_hook(self._optimizer_stepped)
        self._sigterm_before: Any = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # An elastic agent SIGTERMs the other workers as soon as one dies: that must not end a survivor
            # before its save (the agent's SIGKILL comes only after its grace period).
            self._sigterm_before = signal.signal(signal.SIGTERM, self._sigterm)
        self.liveness.start()

    def _sigterm(self, signum: int, frame: Any) -> None:
        if self.liveness.lost(self.config.stale_s):
            log.warning("rank %d: SIGTERM while a peer is lost: the survivor save goes first", self.manager.rank)
            return  # the collective with the lost rank fails, and after_failure saves and exits
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # anything else: the default, as if we were never here

    def _optimizer_stepped(self, *_: Any) -> None:
        self._stepped = True

    def at_boundary(self, step: int) -> None:
        """Called first thing at every step boundary, before any collective of the boundary itself."""
        snapshot = self.boundary(step)
        self.snapshot, self._stepped = snapshot, False
        self.liveness.publish(step, snapshot.rank_state)

    def after_failure(self, error: BaseException | None) -> SurvivorOutcome | None:
        """A collective failed (or never returned): if peers are lost, the survivors save. None: nobody is lost."""
        # The hang rescue and the training thread (whose collective fails once the lost rank's sockets close, or
        # its communicator is aborted) can both get here; the second waits for the first's answer rather than let
        # its error end the process in the middle of that save, with an exit code no launcher restarts on. A thread
        # that finds a lost peer keeps the lock: it saves and exits the process.
        deadline = time.monotonic() + self.config.stale_s + self.config.heartbeat_s + self.config.grace_s + 5.0
        while not self._rescuing.acquire(timeout=0.05):
            if self.outcome is not None or time.monotonic() > deadline:
                return self.outcome
        # A collective fails as soon as the lost peer's sockets close, which in the kernel comes before its process
        # is seen as gone; its heartbeat then still looks fresh. Give it until the heartbeat would be stale.
        deadline = time.monotonic() + self.config.stale_s + self.config.heartbeat_s
        lost = self.liveness.lost(self.config.stale_s)
        while not lost and self.snapshot is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            lost = self.liveness.lost(self.config.stale_s)
        if not lost or self.snapshot is None:
            self._rescuing.release()
            return None
        log.error(
            "rank %d: rank(s) %s are gone (%s); the survivors save step %d",
            self.manager.rank,
            sorted(lost),
            error if error is not None else "a collective never returned",
            self.snapshot.step,
        )
        if self._stepped:  # the state in memory is past the last boundary, and the others' is not known
            self.outcome = SurvivorOutcome(
                self.snapshot.step, False, lost=sorted(lost), reason="an optimizer step ran since the last boundary"
            )
            return self.outcome
        self.liveness.flush()
        self.outcome = survivor_save(
            self.manager,
            step=self.snapshot.step,
            shared=self.snapshot.shared(),
            rank_state=self.snapshot.rank_state,
            lost=lost,
            liveness=self.liveness,
            timeout_s=self.config.grace_s,
        )
        return self.outcome

    def exit(self) -> None:
        """Leave now, with the code the launcher restarts on: collectives with the lost rank can hang teardown.

        Under ``resilience launch`` the process stays: the error unwinds the framework's loop as any error does,
        and the script runs again once the lost rank is replaced (:mod:`resilience.inplace`)."""
        if inplace.active():
            outcome = self.outcome
            inplace.request(
                f"survivor save of step {outcome.step} {'committed' if outcome.committed else 'not committed'}"
                if outcome is not None
                else "a peer was lost"
            )
            return
        log.warning("rank %d: exiting with code %d after losing a peer", self.manager.rank, self.config.exit_code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.config.exit_code)

    def close(self) -> None:
        self._hook.remove()
        if self._sigterm_before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_before)
        self.liveness.close()
