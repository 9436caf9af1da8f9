"""One manager per process; every checkpoint goes through it in clear phases.

    claim(): own the roots for this run (no other live job; leftovers of dead ones cleared; run identity)
    save():  claim if needed -> flatten -> agree (one tiny all-reduce) -> wait if busy -> deal -> stage into
             reused host buffers -> hand off to the background
    writer:  DCP write of this rank's shards -> checksums -> agree -> manifest (local commit) -> retention
    upload:  pick newest ready -> concurrent transfers with retries -> agree -> manifest (durable commit)
    load():  discover (both tiers) -> verify, fall back past bad ones -> DCP load with resharding

The manager composes its parts: the claim on its roots (:mod:`.claim`), discovery and load (:mod:`.restore`),
the staging buffers (:mod:`.staging_area`), the background (:mod:`.background`). Construction, claim(), save()
and load() are collective: call them on every rank.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor

from resilience.checkpoint import open_engines
from resilience.checkpoint.agreement import Agreement
from resilience.checkpoint.background import Background
from resilience.checkpoint.claim import RootClaim
from resilience.checkpoint.deal import SaveTree, Share
from resilience.checkpoint.loader import Restored
from resilience.checkpoint.restore import Restorer, settle_own_save
from resilience.checkpoint.save_events import Listener, SaveEvents
from resilience.checkpoint.save_handle import Commit, SaveHandle, SaveStats
from resilience.checkpoint.staging import Loan, StagingJob
from resilience.checkpoint.staging_area import StagingArea
from resilience.config import CheckpointConfig, WhenBusy
from resilience.dist import Groups, node_identity
from resilience.errors import CheckpointError
from resilience.persist import PersistPipeline
from resilience.persist.heal import HealSettings
from resilience.persist.pipeline import WriteJob, remove_checkpoint
from resilience.storage import catalog
from resilience.storage.owners import Owner
from resilience.storage.peer_copies import Address, link_nodes
from resilience.storage.tiers import DurableTier, LocalTier

log = logging.getLogger(__name__)
T = TypeVar("T")


class CheckpointManager:
    """Saves and loads sharded checkpoints through a fast local tier and an optional durable URL.

    Args:
        config: Where and how; see :class:`CheckpointConfig`.
        listeners: Called (from background threads) with a dict per event: ``local_commit``,
            ``durable_commit``, ``failed``, ``skipped``, ``upload_retry``, ``upload_skipped``, ``deleted``,
            ``peer_copy``, ``peer_copy_failed``;
            more can be added at any time with :meth:`add_listener`.
        protected_steps: Called (from background threads) before retention deletes anything; steps it returns
            are kept beyond ``keep_last`` (e.g. the best-k checkpoints a framework still refers to).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        listeners: list[Listener] | None = None,
        protected_steps: Callable[[], set[int]] | None = None,
    ):
        self.config = config
        self.local = LocalTier(config.local_root)
        self.durable = DurableTier(config.durable_url, config.storage_options) if config.durable_url else None
        self.groups = Groups(config.collective_timeout_s, node_identity(self.local.root))
        self.topology = self.groups.topology
        self.rank = self.topology.rank
        self.world_size = self.topology.world_size
        self.local_shared = config.local_shared if config.local_shared is not None else self.topology.single_node
        self.is_local_leader = (
            self.rank == 0 if self.local_shared else self.rank == min(self.topology.ranks_on_my_node())
        )
        self.events = SaveEvents(self.rank, listeners)
        self.stats = SaveStats()
        self.device_unreadable: str | None = None  # why this rank's GPU must not be read again (a fatal fault)
        self.exit_timeout_s: float | None = None  # how long the process exit waits for saves (None: until done)
        self._roots = RootClaim(
            self.local, self.durable, self.groups.control, self.rank, self.is_local_leader, HealSettings.of(config)
        )
        # names this job's incarnation among others on the same root (liveness records, survivor notes)
        self.job_token: str = self.groups.control.decide(lambda: uuid.uuid4().hex[:12])
        self._peer: Address | None = None  # where this rank's files of each durable step are copied
        servers: list[Address] = []
        if config.peer_copies and not self.local_shared and self.durable is not None:
            self._peer, servers = link_nodes(
                self.local.root, self.topology.nodes, self.rank, self.is_local_leader, self.groups.control.all_gather
            )
        self._restorer = Restorer(
            config, self.local, self.durable, self.groups.control, self._roots, self.rank, self.world_size, servers
        )
        self._handles: dict[int, SaveHandle] = {}
        self._restored: Restored | None = None
        self._staging_area = StagingArea(config)
        self._inflight: SaveHandle | None = None
        self._background = Background(
            config,
            self.local,
            self.durable,
            self.groups,
            self.local_shared,
            self.events,
            self._roots,
            self._note_committed,
            protected_steps or set,
        )
        self._closed = False
        open_engines.opened(self)

    def _note_committed(self, step: int) -> None:
        """The background's report of each local commit. A bound method on purpose: while the background runs it
        keeps this manager alive, and so among the open engines whose saves the process exit waits for, though
        the caller dropped it right after a save."""
        self._roots.note(step)

    @property
    def pipeline(self) -> PersistPipeline:
        """The background half of saves: a helper process per rank, or threads."""
        return self._background.pipeline

    @property
    def run_id(self) -> str | None:
        return self._roots.run_id

    @property
    def owner(self) -> Owner | None:
        return self._roots.owner

    @property
    def lease_token(self) -> str | None:
        """Names this job in the durable lease (rank 0's owner), on every rank."""
        return self._roots.lease_token

    def stop_background(self) -> None:
        """Stop the background half of saves for good (a survivor save is about to write without it): the helper
        process is killed, which may be stuck in a collective with a rank that is gone."""
        self._background.stop()

    def rest(self, *, wait: bool = True) -> bool:
        """Drain, then end what runs in the background until the next save starts it again: the helper process
        (and the thread reading from it) or the writer threads, and the heartbeat of the owner record and lease.

        For an engine that outlives the fit it served (Lightning's CheckpointIO keeps it for saves after
        ``fit()``): a framework's teardown is expected to leave no threads behind (Lightning's own tests fail one
        that does), and a process idling after training has no use for a helper. Call on every rank together,
        as saves are called: the next save then starts every rank's helper together (about 0.3 s here).
        ``wait=False``: rest only if no rank has an upload still running (else the helpers stay at their work;
        collective, so that every rank's helper goes or none); local commits are waited for. Returns whether
        the engine rests.
        """
        if not wait and self.durable is not None and self.groups.control.max([int(bool(self.pending_steps()))])[0]:
            return False
        self.drain()
        self._background.rest()
        return True

    def claim(self, *, resumed_from: int | None = None, run_id: str | None = None) -> str:
        """Begin training on the local root: call when a run (re)starts, before its first save; collective.

        The first call makes this job the root's owner: it refuses a root another live job writes to, and clears
        leftovers of saves whose writer is gone. Every call checks the lineage: a run that starts fresh
        (``resumed_from`` None) on a root holding checkpoints is refused (its steps would be mixed up with
        theirs); one resumed from step ``s`` sets aside the checkpoints newer than ``s`` (an abandoned branch) at
        its first save, so none of its later saves can be mistaken for them, and nothing is moved by a run that
        never saves. Returns the run id (``run_id``: continue that run). :meth:`save` calls it with the step
        last restored if nobody did.
        """
        restored = self._restored if self._restored is not None and self._restored.step == resumed_from else None
        if self._roots.claim(resumed_from, run_id or (restored.manifest.run_id if restored is not None else None)):
            self._handles.clear()  # their steps were set aside
        if resumed_from is not None:
            self._handles = {s: h for s, h in self._handles.items() if s <= resumed_from}
        assert self.run_id is not None
        return self.run_id

    def saved(self, step: int) -> SaveHandle | None:
        """The save of ``step`` this manager made since the last load (or that load), if any: a checkpoint of
        the state in memory now, as far as the caller has not changed it since."""
        return self._handles.get(step)

    def committed_steps(self) -> set[int]:
        """Steps committed (or being saved) in either tier, as this manager knows them."""
        return self._roots.known_steps()

    # ---- save ----------------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        rank_state: Any = None,
        *,
        extra: dict[str, Any] | None = None,
        when_busy: WhenBusy | None = None,
        abstain: Collection[int] = (),
        replicated: Collection[str] | None = None,
    ) -> SaveHandle | None:
        """Stage ``state`` and return; the rest happens in the background. Call on every rank.

        ``state`` is the same tree on every rank (plain tensors are written once, by one of the ranks holding
        them; DTensor shards by their owners). ``rank_state`` differs per rank (RNG, data loader position)
        and is kept per rank. ``extra`` is JSON stored in the manifest. Returns None when the save was
        skipped because the previous one was still running and ``when_busy="skip"`` (the config's, unless
        given here: an emergency save always waits). Ranks in ``abstain`` (a GPU that must not be read) write
        none of the shared state: their replicas do; state they alone held makes the save fail, never commit.

        ``replicated`` names the top-level keys of ``state`` that are alike on every rank (None: all). The plain
        tensors under the other keys may differ per rank; the leader (the lowest rank that writes) writes its
        own, with the skeleton that refers to them, and every rank gets those back: Lightning keeps rank 0's
        checkpoint dict the same way.
        """
        t0 = time.monotonic()
        self._check_open()
        if step < 0:
            raise ValueError(f"step={step}: checkpoint steps are non-negative integers")
        self._claim_step(step)
        self._background.ready()
        tree = SaveTree.of(state, self.world_size, abstain, replicated)
        agreed = self._agree(step, tree)
        if agreed.busy and not self._wait_if_busy(step, when_busy, t0):
            return None
        self.wait_for_staging()
        share = tree.share(self.rank, rank_state, self.device_unreadable)
        handle = SaveHandle(step)
        staging = self._staging_area.stage(handle, share.tensors)
        block_s = time.monotonic() - t0
        self._hand_off(handle, staging, tree, share, extra, block_s)
        self._after_hand_off(handle, staging, tree, block_s)
        return handle

    def _claim_step(self, step: int) -> None:
        """Claim the roots if nobody did (with the step last restored), leave an abandoned branch, and make sure
        ``step`` is new: committed checkpoints are never overwritten."""
        if self.run_id is None:
            self.claim(resumed_from=self._restored.step if self._restored is not None else None)
        self._roots.leave_abandoned_branch()
        self._roots.check_new(step)

    def _agree(self, step: int, tree: SaveTree) -> Agreement:
        """Learn in one all-reduce what stops the save or makes it wait; raise on every rank alike."""
        # busy: no set of staging buffers is free (an earlier save is not committed yet, or its buffers are lent)
        busy = bool(self._staging_area.busy_with())
        errors = self.pipeline.take_errors()
        mine = Agreement.mine(error=bool(errors), busy=busy, alone=bool(tree.alone), digest=tree.digest)
        agreed = Agreement.from_reduced(self.groups.control.max(mine))
        agreed.raise_if_stopped(step, errors, tree.alone, tree.abstain)
        return agreed

    def _wait_if_busy(self, step: int, when_busy: WhenBusy | None, t0: float) -> bool:
        """The previous save still holds the buffers on some rank: skip this one (False), or wait for it."""
        if (when_busy or self.config.when_busy) == "skip":
            self.stats.skipped += 1
            log.warning(
                "Skipping the save of step %s: the save of step %s is still being written (when_busy='skip'; "
                "%d skipped so far). Save less often, or use when_busy='wait'.",
                step,
                self._inflight.step if self._inflight else "?",
                self.stats.skipped,
            )
            self.events.emit("skipped", step)
            self.stats.stall_s += time.monotonic() - t0
            return False
        self.stats.waited_for_previous += 1
        concurrent.futures.wait(self._staging_area.busy_with())
        return True

    def _hand_off(
        self,
        handle: SaveHandle,
        staging: StagingJob,
        tree: SaveTree,
        share: Share,
        extra: dict[str, Any] | None,
        block_s: float,
    ) -> None:
        """The step now exists (no other save may take it); the background writes and commits it."""
        step, rank_flat = handle.step, share.rank_flat
        handle.timings["block_s"] = block_s
        self._roots.note(step)
        self._handles[step] = handle
        self.pipeline.submit(
            WriteJob(
                step=step,
                staging=staging,
                skeleton=share.skeleton,
                rank_skeleton=rank_flat.skeleton if rank_flat else None,
                pickled=tree.flat.pickled + (rank_flat.pickled if rank_flat else []),
                extra=dict(extra or {}),
                handle=handle,
                block_s=block_s,
                run_id=self.run_id,
                writer=self.owner.to_json() if self.owner is not None else None,
                pieces={k: _create_write_items(k, t) for k, t in share.tensors.items() if isinstance(t, DTensor)},
                peer=self._peer,
            )
        )

    def _after_hand_off(self, handle: SaveHandle, staging: StagingJob, tree: SaveTree, block_s: float) -> None:
        """Bookkeeping: the barrier before the next state change, the save in flight, the counters."""
        if tree.flat.pickled and self.stats.saves == 0:
            log.warning(
                "State values at %s are not JSON-expressible and were pickled; loading them will need "
                "allow_pickle=True",
                tree.flat.pickled[:5],
            )
        self._staging_area.hold(staging, self.wait_for_staging)
        self._inflight = handle
        self.stats.saves += 1
        self.stats.block_s.append(block_s)
        self.stats.stall_s += block_s

    def lend_staged(self, handle: SaveHandle) -> Loan | None:
        """The tensors ``handle``'s save staged on this rank (plain tensors, by DCP key), lent until
        the loan is given back: the next save waits for that before it copies into the buffers. None when the
        buffers hold a later save's values already. For a reader of the step that would otherwise read back the
        files just written from them (a name's writer); it must still wait for ``handle.committed``.
        """
        return None if self._closed else self._staging_area.lend(handle)

    def call_off_process(self, function: Callable[[], T]) -> T:
        """``function()`` run off the training process and waited for (picklable, and safe to run twice): in this
        rank's helper process, or in one forked for it (:meth:`Background.call`)."""
        return self._background.call(function)

    def wait_for_staging(self) -> None:
        """With ``async_staging``: return once the state may be changed again (call before ``optimizer.step()``)."""
        if self._staging_area.pending is not None:
            t0 = time.monotonic()
            self._staging_area.release()
            waited = time.monotonic() - t0
            self.stats.staging_wait_s += waited
            self.stats.stall_s += waited

    def wait(self, timeout: float | None = None, *, durable: bool = False) -> bool:
        """Wait until the last save is committed locally (and durably with ``durable``); raise its error.

        True once committed (in the durable tier too, with ``durable`` and one configured); False on timeout,
        or with ``durable`` when a newer checkpoint superseded this one's upload.
        """
        handle = self._inflight
        if handle is None:
            return True
        t0 = time.monotonic()
        future = handle.durable if durable and self.durable is not None else handle.committed
        try:
            result = future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        except CheckpointError as exc:
            self.pipeline.discard_error(exc)  # raised here; not again at the next save
            raise
        finally:
            self.stats.stall_s += time.monotonic() - t0
        self._raise_pending()
        return result is not None

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every save made so far is committed locally and durably (or has failed); raise the first
        failure. False if that took longer than ``timeout``. The manager stays open for later saves."""
        deadline = None if timeout is None else time.monotonic() + timeout
        futures: list[concurrent.futures.Future[Any]] = [
            future for handle in list(self._handles.values()) for future in (handle.committed, handle.durable)
        ]
        for future in futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = concurrent.futures.wait([future], left)
            if not done:
                return False
        self._raise_pending()
        if not self._background.resting:
            self.pipeline.retain()  # what a commit's retention had to keep for later (names, uploads) may go now
        return True

    def check(self) -> None:
        """Raise the first background failure not yet raised (also done by every save)."""
        self._raise_pending()

    def _raise_pending(self) -> None:
        errors = self.pipeline.take_errors()
        if errors:
            raise errors[0]

    # ---- discovery and load --------------------------------------------------------------------------------------

    def latest(self) -> catalog.Entry | None:
        """The newest committed checkpoint that verifies, agreed by all ranks (collective)."""
        return self._restorer.latest()

    def load(
        self,
        target: Any = None,
        *,
        step: int | None = None,
        rank_state: bool = True,
        leave_out: Collection[str] = (),
    ) -> Restored | None:
        """Load the newest verified checkpoint (or ``step``) into ``target``; None if there is none.

        Collective. ``target`` is a state tree with tensors (DTensors are resharded), or a function that makes
        one, called only once a checkpoint is found (making it may change the state: DCP's state-dict API gives
        an optimizer that has not stepped its state by stepping it); without it, tensors are allocated on CPU.
        ``leave_out``: top-level keys of the saved state not to read. A copy that fails
        anywhere in loading (checksums, a shard DCP cannot read, a malformed state file) is set aside and the
        next older one is tried, so the same bad copy never stops a relaunch twice. With ``step`` given and no
        such verified checkpoint, raises NoCheckpointError.
        """
        self._check_open()
        self.wait_for_staging()  # the load fills live tensors in place
        settle_own_save(self._inflight, self.wait)
        restored = self._restorer.load(target, step=step, rank_state=rank_state, leave_out=leave_out)
        if restored is not None:
            self._restored = restored
            # the state in memory is now this step's: earlier saves of this process no longer describe it
            self._handles = {
                restored.step: SaveHandle.done(
                    Commit(restored.step, restored.tier, restored.path, restored.manifest.total_bytes)
                )
            }
        return restored

    # ---- events and close --------------------------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        self.events.add(listener)

    def remove_listener(self, listener: Listener) -> None:
        self.events.remove(listener)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("This CheckpointManager is closed; make a new one")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Finish every queued write and upload, then stop; raises the first background failure."""
        if self._closed:
            return
        self._closed = True
        open_engines.closed(self)
        self.wait_for_staging()
        self._staging_area.disarm_barrier()
        finished = self._background.resting or self.pipeline.close(timeout)
        self._staging_area.close(timeout)
        self._roots.let_go()
        # The gloo groups stay until the job's own destroy_process_group(): destroying them here could tear
        # connections down under a peer that is still finishing its last collective.
        if not finished:
            log.warning("checkpoint threads did not finish within %ss; they are left to the process exit", timeout)
        self._raise_pending()

    def abandon(self) -> None:
        """Close at once, with no collective and no wait for the background: for a process that goes on after its
        peers were lost (:mod:`resilience.recovery.inplace`), when what is in flight can never finish (the helper is
        ended, its saves fail) and the groups are broken. A survivor save has committed what could be."""
        if self._closed:
            return
        self._closed = True
        open_engines.closed(self)
        self._staging_area.abandon()
        self._background.abandon()
        self._staging_area.close(0)
        self._roots.abandon()  # a restart in place takes the lease over as the same run
        self.pipeline.take_errors()  # the saves that could not finish are the survivor save's to replace

    def pending_steps(self) -> list[int]:
        """Steps saved by this manager whose local commit or upload has not ended yet."""
        return sorted(s for s, h in self._handles.items() if not (h.committed.done() and h.durable.done()))

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CheckpointManager", "SaveHandle", "SaveStats", "remove_checkpoint"]
