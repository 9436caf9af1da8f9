"""The session's part in a peer's death or hang: keep what a survivor save needs, and act when it comes.

At every step boundary this keeps a snapshot of the state as of that step (this rank's own part by value, the
shared part as live tensors that stay valid until the next optimizer step) and publishes this rank's own
part for the others (:mod:`resilience.recovery.liveness`). When a collective fails, or the hang watchdog fires while a
collective never returns, it asks the liveness records (and under ``resilience launch`` node 0's launcher, which
declares silent nodes lost) who is gone; if someone is, it posts the rescue notice,
and the survivors commit the last boundary's step among themselves (:mod:`resilience.recovery.survivors`) and the
process exits with a code the launcher restarts on. A rank that sees another's notice joins the save from a side
thread, and an optimizer-step gate keeps the live tensors as of that step while they are copied. A failure with
every peer alive is not ours to handle: it propagates as it is. The training session holds it through
:class:`~resilience.recovery.session_peers.SessionPeerLoss`.
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

import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from resilience.checkpoint.updates import before_update
from resilience.errors import ConfigError
from resilience.recovery import inplace
from resilience.recovery.liveness import Liveness, Notice
from resilience.recovery.survivors import SurvivorOutcome, survivor_save

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager
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


def boundary_from_state(build_state: Callable[[int], SaveState]) -> BoundaryBuilder:
    """Snapshots made with the adapter's save state, its tensors kept as live references."""

    def snapshot(step: int) -> BoundarySnapshot:
        built = build_state(step)
        return BoundarySnapshot(step, built.rank_state, lambda: built)

    return snapshot


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

    @property
    def rescue_s(self) -> float:
        """The longest a survivor's rescue may take, from the failure: the lost peer's heartbeat going stale, the
        save, and a few seconds to leave."""
        return self.stale_s + self.heartbeat_s + self.grace_s + 5.0


def nccl_in_use() -> bool:
    """Whether this process's default group runs NCCL (its backend string names it, for one device type or all)."""
    return dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()


def abort_collectives(rank: int) -> None:
    """Abort this process's NCCL communicators, so that a kernel waiting for a lost rank lets the device go: the
    survivor save then copies the state off it (the training thread's collective fails, and it waits for the
    save's outcome). Gloo has no such way out (in torch 2.13 its ``abort`` leaves a pending ``all_reduce``
    blocked): there the save runs beside the blocked thread, which only reads host memory. Every group goes
    (torch aborts them together), the checkpoint's own included: the survivor save uses none. Run on gloo in the
    tests (``tests/workers/survivor_worker.py``), never on NCCL here (no GPU); a failed abort is logged, and the
    save goes on."""
    if not nccl_in_use():
        return
    try:
        from torch.distributed.distributed_c10d import _abort_process_group  # private: it may move

        _abort_process_group()
    except Exception as exc:  # the save must still be tried
        log.warning("rank %d: aborting the communicators failed: %s", rank, exc)
        return
    log.warning("rank %d: aborted this process's communicators before the survivor save", rank)


class PeerLost(RuntimeError):
    """Raised from an optimizer step held back by a survivor save, once the process goes on without its lost peers
    (under ``resilience launch``): the training loop unwinds to the restart in place."""


class PeerLossWatch:
    """Boundary snapshots and the reaction to a lost peer, for one training session.

    Args:
        on_notice: Called (from the heartbeat thread) when another survivor posts a rescue notice: this rank must
            join the survivor save even if none of its own collectives touches the lost rank.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        config: PeerLossConfig,
        boundary: BoundaryBuilder,
        *,
        on_notice: Callable[[Notice], None] | None = None,
    ):
        self.manager = manager
        self.config = config
        self.boundary = boundary
        self.liveness = Liveness(
            os.path.join(manager.local.root, LIVE_DIR, manager.job_token),
            manager.rank,
            manager.world_size,
            interval_s=config.heartbeat_s,
            on_notice=on_notice,
        )
        self.snapshot: BoundarySnapshot | None = None
        self.outcome: SurvivorOutcome | None = None
        self.rescue_started = False  # someone was found lost, and a survivor save began
        self._stepped = False
        self._rescuing = threading.Lock()
        # The optimizer-step gate: once a survivor save is decided, no update may begin past the boundary it saves
        # (the live tensors must keep that step's values while they are copied), and an update under way must end
        # first. The training thread waits at the gate; under ``resilience launch`` it is let go with an error once
        # the save is done.
        self._gate = threading.Condition()
        self._updating = False
        self._hold_at: int | None = None
        self._released: PeerLost | None = None
        self._training_thread: int | None = None
        self._hooks = [
            before_update(self._update_begins),
            register_optimizer_step_post_hook(self._step_ended),
        ]
        self._sigterm_before: Any = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # An elastic agent SIGTERMs the other workers as soon as one dies: that must not end a survivor
            # before its save (the agent's SIGKILL comes only after its grace period).
            self._sigterm_before = signal.signal(signal.SIGTERM, self._sigterm)
        self.liveness.start()

    def _sigterm(self, signum: int, frame: Any) -> None:
        notice = self.liveness.notice()
        if (notice is not None and self.manager.rank not in notice.lost) or self.liveness.lost(self.config.stale_s):
            log.warning("rank %d: SIGTERM while a peer is lost: the survivor save goes first", self.manager.rank)
            return  # the collective with the lost rank fails, or the notice starts the rescue: that saves and exits
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # anything else: the default, as if we were never here

    def _boundary_step(self) -> int:
        return self.snapshot.step if self.snapshot is not None else -1

    def _update_begins(self) -> None:
        with self._gate:
            if self._updating:  # a closure called again within one step (L-BFGS): the update is under way
                return
            self._gate.wait_for(
                lambda: self._released is not None or self._hold_at is None or self._boundary_step() < self._hold_at
            )
            if self._released is not None:
                raise self._released
            self._updating = True

    def _step_ended(self, *_: Any) -> None:
        with self._gate:
            self._updating = False
            self._stepped = True
            self._gate.notify_all()

    def at_boundary(self, step: int) -> None:
        """Called first thing at every step boundary, before any collective of the boundary itself."""
        snapshot = self.boundary(step)
        with self._gate:
            self.snapshot, self._stepped, self._updating = snapshot, False, False
            self._training_thread = threading.get_ident()
            self._gate.notify_all()
        self.liveness.publish(step, snapshot.rank_state)

    def _hold(self, step: int) -> None:
        """No update past the boundary of ``step`` from now on; returns once no update is under way and this
        rank has reached that boundary (a survivor that learned of the loss from the notice may still be finishing
        the step the others completed), or when waiting cannot help: the training thread is this one, or it does
        not get there within ``stale_s``."""
        with self._gate:
            self._hold_at = step if self._hold_at is None else min(self._hold_at, step)
            if threading.get_ident() != self._training_thread:
                self._gate.wait_for(
                    lambda: not self._updating and self._boundary_step() >= step, timeout=self.config.stale_s
                )

    def release(self) -> None:
        """Let a training thread held at the gate go on, with :class:`PeerLost` (the process restarts in place)."""
        with self._gate:
            self._released = PeerLost(
                f"rank {self.manager.rank}: a peer was lost"
                + (f"; {self.outcome.describe()}" if self.outcome is not None else "")
            )
            self._gate.notify_all()

    def after_failure(self, error: BaseException | None, notice: Notice | None = None) -> SurvivorOutcome | None:
        """A collective failed (or never returned), or another survivor posted ``notice``: if peers are lost, the
        survivors save. None: nobody is lost."""
        # The hang rescue, the notice's rescue and the training thread (whose collective fails once the lost rank's
        # sockets close, or its communicator is aborted) can all get here; a later one waits for the first's answer
        # rather than let its error end the process in the middle of that save, with an exit code no launcher
        # restarts on. A thread that finds a lost peer keeps the lock: it saves and exits the process.
        deadline = time.monotonic() + self.config.rescue_s
        while not self._rescuing.acquire(timeout=0.05):
            if self.outcome is not None or time.monotonic() > deadline:
                return self.outcome
        if self.outcome is not None:
            self._rescuing.release()
            return self.outcome
        notice = notice or self.liveness.notice()
        # every survivor follows the first notice: the same step, the same survivors
        lost = set(notice.lost) if notice is not None else self._find_lost()
        if not lost or self.snapshot is None or not self._can_save_without(lost):
            self._rescuing.release()
            return None
        self.rescue_started = True
        self._hold(notice.step if notice is not None else self._boundary_step())
        snapshot = self.snapshot
        if notice is None:
            notice = self.liveness.announce(snapshot.step, lost)
            lost = set(notice.lost)
        if error is not None:
            seen = str(error)
        else:
            seen = "a collective never returned" if notice.rank == self.manager.rank else f"rank {notice.rank}'s notice"
        log.error(
            "rank %d: rank(s) %s are gone (%s); the survivors save step %d",
            self.manager.rank,
            sorted(lost),
            seen,
            notice.step,
        )
        with self._gate:
            cut = "an optimizer step ran since the last boundary" if self._stepped else None
            cut = "an optimizer update was cut short" if self._updating else cut
        if cut is not None:  # the state in memory is past the last boundary, and the others' is not known
            self.outcome = SurvivorOutcome(snapshot.step, False, lost=sorted(lost), reason=cut)
            return self.outcome
        abort_collectives(self.manager.rank)
        self.liveness.flush()
        self.outcome = survivor_save(
            self.manager,
            step=snapshot.step,
            meeting=notice.step,
            shared=snapshot.shared(),
            rank_state=snapshot.rank_state,
            lost=lost,
            liveness=self.liveness,
            timeout_s=self.config.grace_s,
        )
        return self.outcome

    def _find_lost(self) -> set[int]:
        """Who is gone: ranks whose heartbeat in the shared local tier went stale or whose process is gone, and
        under ``resilience launch`` the ranks of nodes node 0 declared lost (gone whole, or cut off)."""
        lost = self.liveness.lost(self.config.stale_s) | inplace.lost_node_ranks()
        if not self.manager.local_shared:
            return lost  # other nodes' heartbeats are on their own disks: only node 0's word tells
        # A collective fails as soon as the lost peer's sockets close, which in the kernel comes before its
        # process is seen as gone; its heartbeat then still looks fresh. Give it until the heartbeat is stale.
        deadline = time.monotonic() + self.config.stale_s + self.config.heartbeat_s
        while not lost and self.snapshot is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            lost = self.liveness.lost(self.config.stale_s)
        return lost

    def _can_save_without(self, lost: set[int]) -> bool:
        """Whether the survivors can meet to save: through the shared local tier, or with node-local disks when
        they all run on this node (their notices and board are on its disk)."""
        if self.manager.local_shared:
            return True
        survivors = set(range(self.manager.world_size)) - lost
        if survivors <= set(self.manager.topology.ranks_on_my_node()):
            return True
        log.warning(
            "rank %d: rank(s) %s are gone, but the survivors span nodes with disks of their own: no survivor save",
            self.manager.rank,
            sorted(lost),
        )
        return False

    def exit(self) -> None:
        """Leave now, with the code the launcher restarts on: collectives with the lost rank can hang teardown.

        Under ``resilience launch`` the process stays: the error unwinds the framework's loop as any error does,
        and the script runs again once the lost rank is replaced (:mod:`resilience.recovery.inplace`)."""
        if inplace.active():
            outcome = self.outcome
            inplace.request(outcome.describe() if outcome is not None else "a peer was lost")
            self.release()
            return
        log.warning("rank %d: exiting with code %d after losing a peer", self.manager.rank, self.config.exit_code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.config.exit_code)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._sigterm_before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_before)
        self.liveness.close()
