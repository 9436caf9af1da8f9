"""A run's claim on its roots: the local root owned, the durable URL leased, its steps told apart from others'.

A manager composes one :class:`RootClaim`. It knows which steps exist on every node's disk and in the durable
tier (no save may overwrite one), takes the roots when a run (re)starts, and keeps a run that starts fresh or
resumes from an older step from mixing its steps with those it does not continue.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid

from resilience.dist import Channel
from resilience.errors import CheckpointExistsError, ConfigError
from resilience.persist.heal import Healer, HealSettings
from resilience.storage import catalog
from resilience.storage.layout import MANIFEST, SUPERSEDED_DIR, SUPERSEDED_MANIFEST, WRITER_FILE, aside_name
from resilience.storage.lease import Lease, Tenancy
from resilience.storage.owners import Owner, Owners, writer_alive
from resilience.storage.tiers import DurableTier, LocalTier

log = logging.getLogger(__name__)


class RootClaim:
    """What this job holds on the local root and the durable URL, and the steps it knows exist there.

    Construction is collective: it proves both tiers writable (at set-up, not at step N) and learns the steps.
    """

    def __init__(
        self,
        local: LocalTier,
        durable: DurableTier | None,
        control: Channel,
        rank: int,
        is_local_leader: bool,
        heal: HealSettings | None = None,
    ):
        self.local = local
        self.durable = durable
        self.control = control
        self.rank = rank
        self.is_local_leader = is_local_leader
        self.run_id: str | None = None
        self.owner: Owner | None = None
        self.lease_token: str | None = None  # names this job in the durable lease (rank 0's owner), on every rank
        self._owners = Owners(local.root)
        self._tenancy: Tenancy | None = None  # the owner record and durable lease held, and their heartbeat
        self._lease: Lease | None = None  # rank 0's, once claimed
        self._branch_from: int | None = None
        self._heal = heal or HealSettings()  # the durable tier healed at a resume (rank 0, in the background)
        self._healer: Healer | None = None
        self._lock = threading.Lock()  # the writer threads add the steps they commit
        self._known_steps: set[int] = self._startup_checks()

    # ---- the steps that exist ------------------------------------------------------------------------------------

    def _startup_checks(self) -> set[int]:
        """Prove both tiers usable and learn which steps exist, on every node's disk.

        A step that only another node's disk holds (its upload never finished, or rank 0's node was replaced)
        still must not be saved over, and a resume from an older step sets it aside like any newer one.
        """

        def check_local() -> set[int]:
            if not self.is_local_leader:
                return set()
            self.local.check_writable()
            return {e.step for e in catalog.scan(self.local) if e.committed}

        on_disks = self.control.agree(check_local)

        def scan_durable() -> set[int]:
            if self.durable is None:
                return set()
            self.durable.check_writable()
            return {e.step for e in catalog.scan(self.durable) if e.committed}

        return set(self.control.decide(scan_durable)).union(*on_disks)

    def check_new(self, step: int) -> None:
        """Refuse to save ``step`` again: committed checkpoints are never overwritten."""
        with self._lock:
            known = step in self._known_steps
        if known:
            raise CheckpointExistsError(
                f"Step {step} is already saved or being saved under {self.where()}; committed checkpoints are "
                "never overwritten. Save under a new step, or point local_root/durable_url at a new run directory"
            )

    def note(self, step: int) -> None:
        """``step`` is committed, or being saved."""
        with self._lock:
            self._known_steps.add(step)

    def forget(self, step: int) -> None:
        """``step``'s copy was taken out of discovery: it may be saved again."""
        with self._lock:
            self._known_steps.discard(step)

    def known_steps(self) -> set[int]:
        with self._lock:
            return set(self._known_steps)

    def where(self) -> str:
        return f"local_root {self.local.root}" + (f" / durable_url {self.durable.url}" if self.durable else "")

    # ---- claim and release -------------------------------------------------------------------------------------

    def claim(self, resumed_from: int | None, run_id: str | None) -> bool:
        """Own the roots if this job does not yet, and check the lineage (see :meth:`CheckpointManager.claim`);
        collective. ``run_id``: the run to continue, if known. Returns whether the local checkpoints of an
        earlier run were set aside (what the caller saved or loaded before is gone from the root)."""
        first = self.run_id is None
        if first:
            self._take_root_and_url(run_id)
        try:
            superseded = self._check_lineage(resumed_from)  # collective: every rank takes the same branch
        except BaseException:
            if first:
                self._disown()  # refused: this job holds nothing, and its next save is refused the same way
            raise
        self._branch_from = resumed_from
        if first and resumed_from is not None:
            self._start_healing(resumed_from)
        return superseded

    def _start_healing(self, resumed_from: int) -> None:
        """Rank 0, the durable lease's holder, once the roots are claimed for a resume: upload again, in the
        background, this run's local steps the durable tier lacks (:mod:`resilience.persist.heal`)."""
        if self.rank == 0 and self.durable is not None and self.owner is not None and self.run_id is not None:
            writer = self.owner.to_json()
            self._healer = Healer(
                self.local, self.durable, self._heal, run_id=self.run_id, upto=resumed_from, writer=writer
            )

    def _take_root_and_url(self, run_id: str | None) -> None:
        """Choose the run id, own the local root (leftovers of dead writers cleared) and hold the durable URL;
        start the heartbeat that shows both alive. Collective; on failure nothing is left held."""
        proposed = run_id or uuid.uuid4().hex[:16]
        chosen = self.control.decide(lambda: proposed)
        owner = self.owner = Owner.me(chosen)

        def own() -> None:
            if self.is_local_leader:
                self._owners.claim(owner)
                self._clear_leftovers()

        try:
            self.control.agree(own)
            self.lease_token = self.control.decide(lambda: self._take_lease(owner))
        except BaseException:
            self._disown()
            raise
        self._tenancy = Tenancy(self._owners if self.is_local_leader else None, owner, self._lease)
        self._tenancy.heart.start()
        self.run_id = chosen

    def _disown(self) -> None:
        """Undo a refused claim: nothing held, and no run id (the next save claims, and is refused, again)."""
        self.let_go()
        self._tenancy = self._lease = self.owner = None
        self.lease_token = self.run_id = None

    def let_go(self) -> None:
        """Stop the heartbeat, release the durable lease, remove the owner record (a job that writes no more)."""
        self._stop_healing(wait=True)
        if self._tenancy is not None:
            self._tenancy.end()
        if self.owner is not None:
            if self.is_local_leader:
                self._owners.unregister(self.owner)
            self.owner.release()

    def abandon(self) -> None:
        """Let go without a collective, keeping the durable lease: a restart in place takes it over as the same
        run."""
        self._stop_healing(wait=False)
        if self._tenancy is not None:
            self._tenancy.pause(release=False)
        if self.owner is not None:
            if self.is_local_leader:
                with contextlib.suppress(OSError):
                    self._owners.unregister(self.owner)
            self.owner.release()

    def pause(self) -> None:
        """The engine rests: no thread of the pack runs (the heartbeat stops, the lease is released)."""
        self._stop_healing(wait=True)
        if self._tenancy is not None:
            self._tenancy.pause(release=True)

    def _stop_healing(self, *, wait: bool) -> None:
        """A job that lets its lease go heals no more: the healing ends before its next step; the next start
        heals what is left. With ``wait``, the step in flight is finished first, as a closing job's last upload
        is (and no thread is left behind); without, it finishes on its own, fenced by the lease like any upload."""
        if self._healer is not None:
            self._healer.stop()
            if wait:
                self._healer.join()

    def resume(self) -> None:
        """Take the roots back after a rest; collective: every rank stops if a live job took them meanwhile."""
        if self._tenancy is not None:
            self.control.agree(self._tenancy.resume)

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

    # ---- lineage -----------------------------------------------------------------------------------------------

    def _check_lineage(self, resumed_from: int | None) -> bool:
        """No step of another run may look like this run's, when this one starts fresh.

        Another run's checkpoints that only the local tier holds are moved to ``superseded/run-<id>-<time>/``
        (re-running a script keeps working, and nothing is lost); ones in the durable tier cannot be moved
        without copying them, and the new run's uploads would overwrite them: that start is refused. Returns
        whether the local ones were moved.
        """
        if resumed_from is not None:
            return False
        committed = sorted(self.known_steps())
        if not committed:
            return False
        durable = self.control.decide(
            lambda: [e.step for e in catalog.scan(self.durable) if e.committed] if self.durable is not None else []
        )
        if durable:
            raise ConfigError(
                f"{self.where()} already holds checkpoints of another run (steps {_steps_text(sorted(durable))}), and "
                "this run starts fresh: its saves would overwrite those. Resume that run (Lightning: AutoResume() "
                "or fit(ckpt_path='last'); Fabric: resume(fabric, state); Accelerate: resilience.resume(); the "
                "Trainer: train(resume_from_checkpoint=True)), or point local_root and durable_url at a new directory"
            )
        stamp = time.strftime("%Y%m%dT%H%M%S")
        folder = f"{SUPERSEDED_DIR}/run-{stamp}"
        if self.rank == 0:
            log.warning(
                "%s holds checkpoints of an earlier run (steps %s) and this run starts fresh: moving them to %s/%s "
                "(to continue that run instead, resume it: AutoResume(), fit(ckpt_path='last'), resilience.resume())",
                self.where(),
                _steps_text(committed),
                self.local.root,
                folder,
            )
        if self.is_local_leader:
            for step, path in self.local.list_steps().items():
                self.local.rename(path, self.local.path(folder, aside_name(step, stamp)))
        with self._lock:
            self._known_steps.clear()
        return True

    def leave_abandoned_branch(self) -> None:
        """At the first save after a claim that resumed from an older step: set aside the steps newer than it,
        on every rank together (collective), so none of this run's saves can be mistaken for them."""
        if self._branch_from is None:
            return
        branch_from, self._branch_from = self._branch_from, None
        self.control.agree(lambda: self._set_aside_newer(branch_from))
        with self._lock:
            self._known_steps = {s for s in self._known_steps if s <= branch_from}

    def _set_aside_newer(self, resumed_from: int) -> None:
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
                if self.durable.exists(manifest):  # only the manifest: a prefix cannot be moved on an object store
                    self.durable.rename(manifest, f"{self.durable.step_path(step)}/{SUPERSEDED_MANIFEST}{stamp}")


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
