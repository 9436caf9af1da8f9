"""One manager per process; every checkpoint goes through it in clear phases.

    claim(): own the root for this run (no other live job; leftovers of dead ones cleared; run identity)
    save():  agree (one tiny all-reduce) -> flatten -> stage into reused host buffers -> hand off
    writer:  DCP write of this rank's shards -> checksums -> agree -> manifest (local commit) -> retention
    upload:  pick newest ready -> concurrent transfers with retries -> agree -> manifest (durable commit)
    load():  discover (both tiers) -> verify, fall back past bad ones -> DCP load with resharding

Construction, claim(), save() and load() are collective: call them on every rank.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # imported before our exit hook is registered: see _register_exit_hook
import contextlib
import functools
import logging
import os
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from resilience.checkpoint.events import Events, Listener
from resilience.checkpoint.loader import ReadCounter, Restored, plan_load, run_load
from resilience.checkpoint.save_handle import Commit, SaveHandle
from resilience.checkpoint.staging import HostStager, Loan, StagingJob
from resilience.checkpoint.tree import flatten
from resilience.checkpoint.updates import before_update
from resilience.config import CheckpointConfig, WhenBusy
from resilience.dist import Groups, node_identity
from resilience.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleStateError,
    NoCheckpointError,
    describe,
)
from resilience.goodput.ledger import LOAD_PARTS
from resilience.persist import PersistPipeline
from resilience.persist.helper import HelperPipeline, HelperSettings, helper_log_level, helper_preload, start_store
from resilience.persist.pipeline import Pipeline, WriteJob, remove_checkpoint
from resilience.progress import still_going
from resilience.recovery import inplace
from resilience.recovery.survivors import deal_digest, only_held_by, share_among, split_by_origin
from resilience.storage import catalog
from resilience.storage.layout import (
    CORRUPT_MANIFEST,
    MANIFEST,
    QUARANTINE_DIR,
    SUPERSEDED_DIR,
    SUPERSEDED_MANIFEST,
    WRITER_FILE,
    aside_name,
    rank_prefix,
)
from resilience.storage.lease import Lease, Tenancy
from resilience.storage.owners import Owner, Owners, writer_alive
from resilience.storage.proofs import Proofs
from resilience.storage.tiers import DurableTier, LocalTier, Tier

log = logging.getLogger(__name__)


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


class CheckpointManager:
    """Saves and loads sharded checkpoints through a fast local tier and an optional durable URL.

    Args:
        config: Where and how; see :class:`CheckpointConfig`.
        listeners: Called (from background threads) with a dict per event: ``local_commit``,
            ``durable_commit``, ``failed``, ``skipped``, ``upload_retry``, ``upload_skipped``, ``deleted``;
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
        self.events = Events(self.rank, listeners)
        self.stats = SaveStats()
        self.run_id: str | None = None
        self.owner: Owner | None = None
        self.device_unreadable: str | None = None  # why this rank's GPU must not be read again (a fatal fault)
        self.exit_timeout_s: float | None = None  # how long the process exit waits for saves (None: until done)
        self._branch_from: int | None = None
        self._owners = Owners(self.local.root)
        self._tenancy: Tenancy | None = None  # the owner record and durable lease held, and their heartbeat
        self._lease: Lease | None = None  # rank 0's, once claimed
        self.lease_token: str | None = None  # names this job in the durable lease (rank 0's owner), on every rank
        self._known_steps: set[int] = self._startup_checks()
        # names this job's incarnation among others on the same root (liveness records, survivor notes)
        self.job_token: str = self.groups.control.decide(lambda: uuid.uuid4().hex[:12])
        self._handles: dict[int, SaveHandle] = {}
        self._restored: Restored | None = None
        self._stager = HostStager(config.pin_memory, shared=config.persist == "process")
        self._staging: StagingJob | None = None
        self._staged: tuple[SaveHandle, StagingJob] | None = None  # the save whose values the buffers hold
        self._loans: list[Loan] = []
        self._barrier_hooks: list[RemovableHandle] = []
        self._inflight: SaveHandle | None = None
        self._lock = threading.Lock()
        self._protected_steps = protected_steps or set
        self._helper_generation = 0
        self._resting = False  # the helper was ended by rest(); the next save starts a new one
        self._helper_store: Any = None
        self.pipeline: PersistPipeline = self._start_pipeline()
        self._closed = False
        _OPEN.add(self)
        _register_exit_hook()

    # ---- start-up ----------------------------------------------------------------------------------------------

    def _start_pipeline(self) -> PersistPipeline:
        """The background half of saves: a helper process per rank (collective: they form a group), or threads."""
        if self.config.persist == "thread":
            return Pipeline(
                self.config,
                self.local,
                self.durable,
                self.topology,
                self.groups.writer,
                self.groups.upload,
                self.local_shared,
                self.events,
                self._note_committed,
                self._protected_steps,
            )
        if self._helper_store is None:
            host, port, self._helper_store = start_store(self.topology, self.groups.control)
            self._helper_address = (host, port)
        settings = HelperSettings(
            config=self.config,
            topology=self.topology,
            local_shared=self.local_shared,
            store_host=self._helper_address[0],
            store_port=self._helper_address[1],
            generation=self._helper_generation,
            log_level=helper_log_level(),
            preload=helper_preload(),
            environ=dict(os.environ),
            parent_pid=os.getpid(),
        )
        return HelperPipeline(settings, self.events, self._note_committed, self._protected_steps)

    def stop_background(self) -> None:
        """Stop the background half of saves for good (a survivor save is about to write without it): the helper
        process is killed, which may be stuck in a collective with a rank that is gone."""
        if isinstance(self.pipeline, HelperPipeline) and not self._resting:
            self.pipeline.kill()

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
        if not self._resting:
            self.pipeline.close()  # a helper is ended; threads have ended with their work, and are joined
            self._resting = True
            if self._tenancy is not None:
                self._tenancy.pause(release=True)  # no thread of the pack runs while it rests
        return True

    def _check_helpers(self) -> None:
        """A helper died on some rank: every rank restarts its own (a new group), or all raise (collective)."""
        pipeline = self.pipeline
        dead = int(isinstance(pipeline, HelperPipeline) and pipeline.died is not None)
        if not self.groups.control.max([dead])[0]:
            return
        assert isinstance(pipeline, HelperPipeline)
        why = pipeline.died or "the checkpoint helper process of another rank died"
        if self.config.on_helper_death == "raise":
            raise CheckpointError(
                f"{why}: its saves were not committed; stopping (on_helper_death='raise'). Use "
                "on_helper_death='restart' to go on with new helpers, or persist='thread'"
            )
        log.warning("%s: the saves it held are not committed; restarting every rank's helper", why)
        pipeline.kill()
        self.pipeline.take_errors()  # the lost saves are reported above, not raised
        self._helper_generation += 1
        self.pipeline = self._start_pipeline()

    def _startup_checks(self) -> set[int]:
        """Prove both tiers usable (at set-up, not at step N) and learn which steps exist, on every node's disk.

        A step that only another node's disk holds (its upload never finished, or rank 0's node was replaced)
        still must not be saved over, and a resume from an older step sets it aside like any newer one.
        """

        def check_local() -> set[int]:
            if not self.is_local_leader:
                return set()
            self.local.check_writable()
            return {e.step for e in catalog.scan(self.local) if e.committed}

        on_disks = self.groups.control.agree(check_local)

        def scan_durable() -> set[int]:
            if self.durable is None:
                return set()
            self.durable.check_writable()
            return {e.step for e in catalog.scan(self.durable) if e.committed}

        return set(self.groups.control.decide(scan_durable)).union(*on_disks)

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
        first = self.run_id is None
        if first:
            self._take_root_and_url(resumed_from, run_id)
        try:
            self._check_lineage(resumed_from)  # collective: every rank takes the same branch
        except BaseException:
            if first:
                self._disown()  # refused: this job holds nothing, and its next save is refused the same way
            raise
        self._branch_from = resumed_from
        if resumed_from is not None:
            self._handles = {s: h for s, h in self._handles.items() if s <= resumed_from}
        assert self.run_id is not None
        return self.run_id

    def _take_root_and_url(self, resumed_from: int | None, run_id: str | None) -> None:
        """Choose the run id, own the local root (leftovers of dead writers cleared) and hold the durable URL;
        start the heartbeat that shows both alive. Collective; on failure nothing is left held."""
        restored = self._restored if self._restored is not None and self._restored.step == resumed_from else None
        proposed = run_id or (restored.manifest.run_id if restored is not None else None) or uuid.uuid4().hex[:16]
        chosen = self.groups.control.decide(lambda: proposed)
        owner = self.owner = Owner.me(chosen)

        def own() -> None:
            if self.is_local_leader:
                self._owners.claim(owner)
                self._clear_leftovers()

        try:
            self.groups.control.agree(own)
            self.lease_token = self.groups.control.decide(lambda: self._take_lease(owner))
        except BaseException:
            self._disown()
            raise
        self._tenancy = Tenancy(self._owners if self.is_local_leader else None, owner, self._lease)
        self._tenancy.heart.start()
        self.run_id = chosen

    def _disown(self) -> None:
        """Undo a refused claim: nothing held, and no run id (the next save claims, and is refused, again)."""
        self._let_go()
        self._tenancy = self._lease = self.owner = None
        self.lease_token = self.run_id = None

    def _let_go(self) -> None:
        """Stop the heartbeat, release the durable lease, remove the owner record (a job that writes no more)."""
        if self._tenancy is not None:
            self._tenancy.end()
        if self.owner is not None:
            if self.is_local_leader:
                self._owners.unregister(self.owner)
            self.owner.release()

    def _take_lease(self, owner: Owner) -> str:
        """Rank 0: hold the durable URL for this job, or refuse to start where another live job writes to it.
        Returns the token the lease names this job by."""
        if self.durable is not None:
            lease = Lease(self.durable, owner)
            lease.acquire()
            self._lease = lease
        return owner.token

    def _clear_leftovers(self) -> None:
        """Remove uncommitted step directories whose writer is gone; a later save may need the name."""
        for entry in catalog.scan(self.local):
            if entry.problem != catalog.NOT_COMMITTED:
                continue
            if writer_alive(f"{entry.path}/{WRITER_FILE}"):
                log.info("leaving %s alone: its writer is still at work", entry.where())
                continue
            log.info("removing uncommitted leftover %s", entry.where())
            self.local.remove_dir(entry.path)

    def _check_lineage(self, resumed_from: int | None) -> None:
        """No step of another run may look like this run's, when this one starts fresh.

        Another run's checkpoints that only the local tier holds are moved to ``superseded/run-<id>-<time>/``
        (re-running a script keeps working, and nothing is lost); ones in the durable tier cannot be moved
        without copying them, and the new run's uploads would overwrite them: that start is refused.
        """
        if resumed_from is not None:
            return
        with self._lock:
            committed = sorted(self._known_steps)
        if not committed:
            return
        durable = self.groups.control.decide(
            lambda: [e.step for e in catalog.scan(self.durable) if e.committed] if self.durable is not None else []
        )
        if durable:
            raise ConfigError(
                f"{self._where()} already holds checkpoints of another run (steps {_steps_text(sorted(durable))}), and "
                "this run starts fresh: its saves would overwrite those. Resume that run (Lightning: AutoResume() "
                "or fit(ckpt_path='last'); Accelerate: resilience.resume()), or point local_root and durable_url "
                "at a new directory"
            )
        stamp = time.strftime("%Y%m%dT%H%M%S")
        folder = f"{SUPERSEDED_DIR}/run-{stamp}"
        if self.rank == 0:
            log.warning(
                "%s holds checkpoints of an earlier run (steps %s) and this run starts fresh: moving them to %s/%s "
                "(to continue that run instead, resume it: AutoResume(), fit(ckpt_path='last'), resilience.resume())",
                self._where(),
                _steps_text(committed),
                self.local.root,
                folder,
            )
        if self.is_local_leader:
            for step, path in self.local.list_steps().items():
                self.local.rename(path, self.local.path(folder, aside_name(step, stamp)))
        with self._lock:
            self._known_steps.clear()
        self._handles.clear()

    def _leave_abandoned_branch(self, resumed_from: int) -> None:
        """Before a run resumed from an older step writes: set aside the steps newer than it."""
        with self._lock:
            newer = [step for step in sorted(self._known_steps) if step > resumed_from]
        if newer and self.rank == 0:
            log.warning(
                "resumed from step %d while steps %s exist: setting those aside as an abandoned branch "
                "(local copies under %s/%s)",
                resumed_from,
                _steps_text(newer),
                self.local.root,
                SUPERSEDED_DIR,
            )
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for step in newer:
            if self.is_local_leader and self.local.exists(self.local.step_path(step)):
                self.local.rename(self.local.step_path(step), self.local.path(SUPERSEDED_DIR, aside_name(step, stamp)))
            if self.rank == 0 and self.durable is not None:
                manifest = self.durable.step_path(step, MANIFEST)
                if self.durable.exists(manifest):
                    self.durable.rename_manifest(
                        manifest, f"{self.durable.step_path(step)}/{SUPERSEDED_MANIFEST}{stamp}"
                    )

    def _where(self) -> str:
        return f"local_root {self.local.root}" + (f" / durable_url {self.durable.url}" if self.durable else "")

    def _note_committed(self, step: int) -> None:
        with self._lock:
            self._known_steps.add(step)

    def saved(self, step: int) -> SaveHandle | None:
        """The save of ``step`` this manager made since the last load (or that load), if any: a checkpoint of
        the state in memory now, as far as the caller has not changed it since."""
        return self._handles.get(step)

    def committed_steps(self) -> set[int]:
        """Steps committed (or being saved) in either tier, as this manager knows them."""
        with self._lock:
            return set(self._known_steps)

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
        record_crcs: bool = False,
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

        ``record_crcs``: the shards' zip records get their CRC-32s, for a save that a framework file will be
        copied from (a Lightning name: its records need them, and without :data:`resilience.formats.crc.FAST` taking
        them is cheaper than computing them again). Otherwise torch's pass over the bytes to compute them is
        skipped; nothing reads them.
        """
        t0 = time.monotonic()
        self._check_open()
        if step < 0:
            raise ValueError(f"step={step}: checkpoint steps are non-negative integers")
        if self.run_id is None:
            self.claim(resumed_from=self._restored.step if self._restored is not None else None)
        if self._branch_from is not None:
            branch_from, self._branch_from = self._branch_from, None
            self.groups.control.agree(lambda: self._leave_abandoned_branch(branch_from))
            with self._lock:
                self._known_steps = {s for s in self._known_steps if s <= branch_from}
        if step in self._known_steps:
            raise CheckpointExistsError(
                f"Step {step} is already saved or being saved under {self._where()}; committed checkpoints are "
                "never overwritten. Save under a new step, or point local_root/durable_url at a new run directory"
            )
        if self._resting:
            if self._tenancy is not None:
                self.groups.control.agree(self._tenancy.resume)  # every rank stops if a live job took it
            self._resting = False
            self._helper_generation += 1  # a new group of helpers
            self.pipeline = self._start_pipeline()
        self._check_helpers()
        # busy: the previous save is not committed yet, or its buffers are still lent to a reader
        busy = (self._inflight is not None and not self._inflight.committed.done()) or bool(self._lent())
        errors = self.pipeline.take_errors()
        flat = flatten(state)
        dealt, leaders = split_by_origin(flat.tensors, replicated)
        digest = deal_digest(dealt)
        writers = [r for r in range(self.world_size) if r not in set(abstain)]
        alone = only_held_by(flat.tensors, set(abstain)) if abstain else []
        any_error, any_busy, any_alone, high, negated_low = self.groups.control.max(
            [int(bool(errors)), int(busy), int(bool(alone)), digest, -digest]
        )
        if any_alone:
            what = f" (e.g. {alone[0]!r} here)" if alone else ""
            raise CheckpointError(
                f"part of the state{what} is held only by rank(s) {sorted(abstain)}, whose GPU must not be read "
                "(sharded state with no replica): the save stands down, and a resume uses the last commit",
                step=step,
            )
        if any_error:
            raise (
                errors[0]
                if errors
                else CheckpointError(
                    "A checkpoint failed on another rank (see that rank's log); stopping so no rank runs ahead",
                    step=step,
                )
            )
        if high != -negated_low:
            raise CheckpointError(
                "the ranks' shared states differ in their tensors (names, dtypes or shapes), so their shares would "
                "not cover the state: every rank must pass the same tree as state (what differs per rank belongs in "
                "rank_state)",
                step=step,
            )
        if any_busy:
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
                return None
            self.stats.waited_for_previous += 1
            previous: list[concurrent.futures.Future[Any]] = [loan.returned for loan in self._lent()]
            if self._inflight is not None:
                previous.append(self._inflight.committed)
            concurrent.futures.wait(previous)
        self.wait_for_staging()
        rank_flat = flatten(rank_state, prefix=rank_prefix(self.rank)) if rank_state is not None else None
        if not writers:
            raise CheckpointError("every rank abstains from this save: there is no healthy replica to write it")
        leader = self.rank == writers[0]
        shared = share_among(dealt, self.rank, writers)
        if (shared or (leader and leaders)) and self.device_unreadable:
            raise CheckpointError(
                f"rank {self.rank}'s GPU must not be read ({self.device_unreadable}), yet a save asked it for its "
                "share: pass the sick ranks as abstain"
            )
        tensors = dict(shared)
        tensors.update(leaders if leader else {})
        tensors.update(rank_flat.tensors if rank_flat else {})
        self._loans = []  # every loan is back (waited for above, or none was out: busy)
        staging = self._stager.stage(tensors, asynchronous=self.config.async_staging)
        handle = SaveHandle(step)
        self._staged = (handle, staging)
        if not self.config.async_staging:
            handle.staged.set_result(None)
        block_s = time.monotonic() - t0
        handle.timings["block_s"] = block_s
        with self._lock:
            self._known_steps.add(step)
        self._handles[step] = handle
        self.pipeline.submit(
            WriteJob(
                step=step,
                staging=staging,
                skeleton=flat.skeleton if leader else None,
                rank_skeleton=rank_flat.skeleton if rank_flat else None,
                pickled=flat.pickled + (rank_flat.pickled if rank_flat else []),
                extra=dict(extra or {}),
                handle=handle,
                block_s=block_s,
                run_id=self.run_id,
                writer=self.owner.to_json() if self.owner is not None else None,
                pieces={k: _create_write_items(k, t) for k, t in tensors.items() if isinstance(t, DTensor)},
                record_crcs=record_crcs,
            )
        )
        if flat.pickled and self.stats.saves == 0:
            log.warning(
                "State values at %s are not JSON-expressible and were pickled; loading them will need "
                "allow_pickle=True",
                flat.pickled[:5],
            )
        if self.config.async_staging:
            self._staging = staging
            self._arm_staging_barrier()
        self._inflight = handle
        self.stats.saves += 1
        self.stats.block_s.append(block_s)
        self.stats.stall_s += block_s
        return handle

    def lend_staged(self, handle: SaveHandle) -> Loan | None:
        """The tensors ``handle``'s save staged on this rank (plain tensors, by DCP key), lent until
        the loan is given back: the next save waits for that before it copies into the buffers. None when the
        buffers hold a later save's values already. For a reader of the step that would otherwise read back the
        files just written from them (a name's writer); it must still wait for ``handle.committed``.
        """
        if self._staged is None or self._staged[0] is not handle or self._closed:
            return None
        tensors = {key: t for key, t in self._staged[1].staged.items() if not isinstance(t, DTensor)}
        loan = Loan(tensors)
        self._loans.append(loan)
        return loan

    def _lent(self) -> list[Loan]:
        return [loan for loan in self._loans if not loan.returned.done()]

    def wait_for_staging(self) -> None:
        """With ``async_staging``: return once the state may be changed again (call before ``optimizer.step()``)."""
        if self._staging is not None:
            t0 = time.monotonic()
            self._staging.release_source()
            waited = time.monotonic() - t0
            self.stats.staging_wait_s += waited
            self.stats.stall_s += waited
            self._staging = None

    def _arm_staging_barrier(self) -> None:
        """Make the next state change wait for the pending copy, without the caller having to remember.

        The hooks are global; they are put in place with the copy and removed at the next save or at close (not
        from inside a hook, while torch walks its hook table), and do nothing once the copy is done. The wait
        comes just before the update (:mod:`resilience.checkpoint.updates`), so the copy still overlaps a closure's
        forward and backward.
        """
        self._disarm_staging_barrier()

        def before_forward(*_: Any) -> None:
            self.wait_for_staging()

        if self.config.staging_barrier == "forward":
            self._barrier_hooks.append(register_module_forward_pre_hook(before_forward))
        self._barrier_hooks.append(before_update(self.wait_for_staging, active=lambda: self._staging is not None))

    def _disarm_staging_barrier(self) -> None:
        for hook in self._barrier_hooks:
            hook.remove()
        self._barrier_hooks = []

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
        if not self._resting:
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
        return self._choose(None)

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
        self._settle_own_save()
        allow_pickle = self.config.allow_pickle or os.environ.get("RESILIENCE_ALLOW_PICKLE") == "1"
        rejected: set[tuple[int, str]] = set()
        # where the time goes, copies set aside included: listing the tiers, checksums, the read itself
        timings = dict.fromkeys(LOAD_PARTS, 0.0)
        while True:
            entry = self._choose(step, rejected, timings)
            if entry is None:
                if step is not None:
                    raise NoCheckpointError(
                        f"No committed checkpoint of step {step} verifies under {self._where()}: run "
                        "`resilience ls` to see what exists"
                    )
                return None
            began = time.monotonic()
            try:
                restored = self._load_entry(
                    entry, target, rank_state=rank_state, allow_pickle=allow_pickle, leave_out=leave_out
                )
            except IncompatibleStateError:
                raise
            except CorruptCheckpointError as exc:
                self._warn(f"Skipping {entry.where()}: {exc}; trying an older checkpoint")
                self._take_out(entry, definitely_corrupt=True)
                rejected.add((entry.step, entry.tier.name))
                continue
            except CheckpointError as exc:
                self._warn(f"Skipping {entry.where()} for now: {exc}; trying an older checkpoint")
                rejected.add((entry.step, entry.tier.name))
                continue
            finally:
                timings["read_s"] += time.monotonic() - began
            restored.timings = timings
            self._restored = restored
            # the state in memory is now this step's: earlier saves of this process no longer describe it
            self._handles = {
                restored.step: SaveHandle.done(
                    Commit(restored.step, restored.tier, restored.path, restored.manifest.total_bytes)
                )
            }
            return restored

    def _settle_own_save(self) -> None:
        """This process's last save is the newest state it knows: a load waits for its local commit, so that a
        load right after a save (a rollback) reads it rather than an older checkpoint; a failed save raises."""
        handle = self._inflight
        if handle is None or handle.committed.done():
            return
        log.info("waiting for the save of step %d to commit before loading", handle.step)
        try:
            self.wait()
        except CheckpointError as exc:
            raise CheckpointError(
                f"load: the save of step {handle.step} made before it did not commit ({exc}); to load the newest "
                "committed checkpoint instead, pass its step"
            ) from exc

    def _load_entry(
        self, entry: catalog.Entry, target: Any, *, rank_state: bool, allow_pickle: bool, leave_out: Collection[str]
    ) -> Restored:
        """Read one copy on every rank. A problem on one rank must stop every rank, not leave the others waiting in
        the collective read: each phase ends with the ranks agreeing on its outcome (and nothing else crosses)."""
        box: dict[str, Any] = {}

        def plan() -> None:
            tree = target() if callable(target) else target
            box["plan"] = plan_load(entry, tree, rank=self.rank, want_rank_state=rank_state, leave_out=leave_out)

        def read() -> None:
            box["restored"] = run_load(
                entry,
                box["plan"],
                group=self.groups.control.group,
                allow_pickle=allow_pickle,
                local=self.local,
                check_reads=not self._hashes_before_load(entry),
                trust_proofs=self.config.verify == "auto",
                read=counter,
            )

        self.groups.control.agree(plan)
        counter = ReadCounter()
        size = f"{entry.manifest.total_bytes / 2**30:.2f} GiB" if entry.manifest is not None else "size unknown"
        what = f"reading step {entry.step} from the {entry.tier.name} tier ({size})"

        def done() -> str:
            return f"{counter.bytes / 2**30:.2f} GiB read on this rank"

        with still_going(what, enabled=self.rank == 0, detail=done):
            self.groups.control.agree(read)
        restored: Restored = box["restored"]
        return restored

    def _choose(
        self, step: int | None, rejected: set[tuple[int, str]] | None = None, timings: dict[str, float] | None = None
    ) -> catalog.Entry | None:
        """The newest copy that verifies (of ``step``), not ``rejected``; adds to ``timings``' discovery and
        verification seconds."""
        spent = timings if timings is not None else dict.fromkeys(LOAD_PARTS, 0.0)

        def listed() -> list[tuple[str, int, str, Any, str | None]]:
            return [
                (e.tier.name, e.step, e.path, e.manifest, e.problem)
                for e in catalog.candidates([self.local, self.durable], invalid=True)
                if (step is None or e.step == step) and (e.step, e.tier.name) not in (rejected or set())
            ]

        # Rank 0 lists once; every rank verifies a share of the files, so a full check scales with ranks.
        tiers: dict[str, Tier | None] = {"local": self.local, "durable": self.durable}
        began = time.monotonic()
        entries = [
            catalog.Entry(s, tier, path, manifest, problem)
            for name, s, path, manifest, problem in self.groups.control.decide(listed)
            if (tier := tiers[name]) is not None
        ]
        spent["discover_s"] += time.monotonic() - began
        share = (self.rank, self.world_size)

        def verify(entry: catalog.Entry) -> str | None:
            began = time.monotonic()
            try:
                return self._verify_together(entry, share)
            finally:
                spent["verify_s"] += time.monotonic() - began

        return catalog.first_verified(entries, verify, self._warn)

    def _hashes_before_load(self, entry: catalog.Entry) -> bool:
        """Whether discovery hashes this copy's shards: with ``verify="auto"`` only the local tier's (the durable
        tier's are hashed as they are read instead, so each is downloaded once); ``"size"`` never."""
        return self.config.verify == "full" or (self.config.verify == "auto" and entry.tier is self.local)

    def _verify_together(self, entry: catalog.Entry, share: tuple[int, int]) -> str | None:
        """Every rank checks its share; a problem anywhere rejects the copy everywhere (corrupt ones set aside)."""
        full = self._hashes_before_load(entry)
        proven = Proofs(entry.path) if self.config.verify == "auto" and entry.tier is self.local else None
        try:
            self.groups.control.agree(lambda: catalog.verify(entry, full=full, share=share, proven=proven))
        except CorruptCheckpointError as exc:
            self._take_out(entry, definitely_corrupt=True)
            return str(exc)
        except CheckpointError as exc:
            return str(exc)
        except Exception as exc:
            return describe(exc)
        return None

    def _take_out(self, entry: catalog.Entry, *, definitely_corrupt: bool) -> None:
        """Take a corrupt copy out of discovery without deleting it, so its step can be saved again."""
        if definitely_corrupt:
            with self._lock:
                self._known_steps.discard(entry.step)
        if self.rank == 0 and definitely_corrupt:
            self._quarantine(entry)
        self.groups.control.barrier()

    def _quarantine(self, entry: catalog.Entry) -> None:
        """A local copy moves to ``<local_root>/quarantine/``; in an object store, where moving a prefix is a
        copy of every object, only its manifest is renamed."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        try:
            if isinstance(entry.tier, LocalTier):
                aside = entry.tier.path(QUARANTINE_DIR, aside_name(entry.step, stamp))
                entry.tier.rename(entry.path, aside)
            else:
                assert isinstance(entry.tier, DurableTier)
                aside = f"{entry.path}/{CORRUPT_MANIFEST}{stamp}"
                entry.tier.rename_manifest(f"{entry.path}/{MANIFEST}", aside)
            log.warning("quarantined corrupt %s as %s", entry.where(), entry.tier.display(aside))
        except Exception as exc:
            log.warning("could not quarantine %s: %s", entry.where(), exc)

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(message, stacklevel=3)

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
        _OPEN.discard(self)
        self.wait_for_staging()
        self._disarm_staging_barrier()
        finished = self._resting or self.pipeline.close(timeout)
        # a reader in another process maps the buffers by name, which closing the stager unlinks
        concurrent.futures.wait([loan.returned for loan in self._lent()], timeout)
        self._stager.close()
        self._let_go()
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
        _OPEN.discard(self)
        if self._staging is not None:
            with contextlib.suppress(Exception):  # a copy into host memory: local, it ends
                self._staging.release_source()
            self._staging = None
        self._disarm_staging_barrier()
        if isinstance(self.pipeline, HelperPipeline):
            if not self._resting:
                self.pipeline.kill()
        else:
            self.pipeline.close(0)  # writer threads stuck in a collective with a lost rank are left to fail
        self._stager.close()
        if self._tenancy is not None:
            self._tenancy.pause(release=False)  # a restart in place takes the lease over as the same run
        if self.owner is not None:
            if self.is_local_leader:
                with contextlib.suppress(OSError):
                    self._owners.unregister(self.owner)
            self.owner.release()
        self.pipeline.take_errors()  # the saves that could not finish are the survivor save's to replace

    def pending_steps(self) -> list[int]:
        """Steps saved by this manager whose local commit or upload has not ended yet."""
        return sorted(s for s, h in self._handles.items() if not (h.committed.done() and h.durable.done()))

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")


_OPEN: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def _abandon_open() -> None:
    """Before a restart in place: the generation's engines still open are closed without collectives."""
    for manager in list(_OPEN):
        manager.abandon()


inplace.before_next_generation(_abandon_open)
# A forked child (a DataLoader worker) inherits the open engines, and threading's exit hooks run when it ends:
# closing them there would close the parent's helper over the inherited connection. They are not the child's.
os.register_at_fork(after_in_child=_OPEN.clear)


@functools.cache
def _register_exit_hook() -> None:
    """Run :func:`_finish_at_exit` when the main thread ends (cached: registered once per process).

    Threading's exit hooks run before any ``atexit`` one, while every thread and the process group still live
    (Lightning destroys its group in an ``atexit`` hook), and in reverse order of registration: registered after
    ``concurrent.futures.thread`` is imported, this one runs before that module's own, which refuses new work
    from then on (an upload started at exit failed with "cannot schedule new futures after interpreter
    shutdown", its checkpoint committed locally only). ``threading._register_atexit`` is private, but the
    standard library's executors use it for exactly this.
    """
    threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined]


def _finish_at_exit() -> None:
    """A save made just before the script ends still commits: the exit waits for it, and says so.

    Without this the interpreter would tear the writer threads down mid-write (a save outside ``fit()``,
    followed by the end of the script, was lost that way, with an abort in the threads' gloo calls).
    """
    for manager in list(_OPEN):
        pending = manager.pending_steps()
        if pending:
            log.warning("waiting for checkpoint step(s) %s to commit before the process exits", pending)
            print(
                f"training-resilience: waiting for checkpoint step(s) {pending} to commit before exit",
                flush=True,
            )
        try:
            manager.close(manager.exit_timeout_s)
        except Exception as exc:
            log.error("a checkpoint failed while the process was exiting: %s", describe(exc))


__all__ = ["CheckpointManager", "SaveHandle", "SaveStats", "remove_checkpoint"]
