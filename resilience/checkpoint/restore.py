"""Discovery and load: the newest copy that verifies, found and read by every rank together.

A manager composes one :class:`Restorer`. Rank 0 lists both tiers once; every rank verifies a share of the
files, and the next older copy is tried past one that fails. A copy is set aside (quarantined) only on evidence
that it is damaged: a file missing, or at a size or checksum other than its manifest's, or a state file that
cannot be parsed; so the same bad copy never stops a relaunch twice. A read that failed otherwise (storage that
did not answer, an error nobody can pin on the bytes until they are hashed again) leaves the copy in place, and a
stop signal during the load ends it without judging the copy at all.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from resilience import leaving
from resilience.checkpoint.claim import RootClaim
from resilience.checkpoint.loader import ReadCounter, Restored, plan_load, run_load
from resilience.checkpoint.save_handle import SaveHandle
from resilience.config import CheckpointConfig
from resilience.dist import Channel
from resilience.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleStateError,
    NoCheckpointError,
    ReadInterruptedError,
    UncheckedReadError,
    describe,
)
from resilience.goodput.ledger import LOAD_PARTS
from resilience.progress import still_going
from resilience.storage import catalog
from resilience.storage.dcp_fs import LocalCopy, NearCopies
from resilience.storage.layout import (
    CORRUPT_MANIFEST,
    MANIFEST,
    QUARANTINE_DIR,
    WRITER_FILE,
    aside_name,
    parse_step_dirname,
)
from resilience.storage.peer_copies import Address, PeerCopies
from resilience.storage.proofs import Proofs
from resilience.storage.tiers import DurableTier, LocalTier, Tier

log = logging.getLogger(__name__)


class Restorer:
    """Finds, verifies and reads checkpoints for one manager; every method is collective."""

    def __init__(
        self,
        config: CheckpointConfig,
        local: LocalTier,
        durable: DurableTier | None,
        control: Channel,
        roots: RootClaim,
        rank: int,
        world_size: int,
        peer_servers: list[Address] | None = None,
    ):
        self.config = config
        self.local = local
        self.durable = durable
        self.control = control
        self.roots = roots  # a copy set aside as corrupt is no longer a step that exists
        self.rank = rank
        self.world_size = world_size
        self.peer_servers = peer_servers or []  # the nodes' peer-copy servers (peer copies)
        self._unmanifested: list[catalog.Entry] = []  # rank 0: durable step folders without a manifest, as listed

    def latest(self) -> catalog.Entry | None:
        """The newest committed checkpoint that verifies, agreed by all ranks."""
        return self._choose(None)

    def load(self, target: Any, *, step: int | None, rank_state: bool, leave_out: Collection[str]) -> Restored | None:
        """The newest verified copy (of ``step``) read into ``target``, older ones tried past bad ones; see
        :meth:`CheckpointManager.load`."""
        allow_pickle = self.config.allow_pickle or os.environ.get("RESILIENCE_ALLOW_PICKLE") == "1"
        rejected: set[tuple[int, str]] = set()
        # where the time goes, copies set aside included: listing the tiers, checksums, the read itself
        timings = dict.fromkeys(LOAD_PARTS, 0.0)
        while True:
            entry = self._choose(step, rejected, timings)
            if entry is None:
                if step is not None:
                    raise NoCheckpointError(
                        f"No committed checkpoint of step {step} verifies under {self.roots.where()}: run "
                        "`resilience ls` to see what exists"
                    )
                if self.rank == 0 and (note := set_aside_note(self.local, self.durable)) is not None:
                    log.warning("%s", note)
                if step is None:
                    self._say_unmanifested(None)
                return None
            began = time.monotonic()
            try:
                restored = self.load_entry(
                    entry, target, rank_state=rank_state, allow_pickle=allow_pickle, leave_out=leave_out
                )
            except (IncompatibleStateError, ReadInterruptedError):
                raise
            except CheckpointError as exc:
                leaving.leave_if_decided()  # a failure after a stop began says nothing of the copy: it stays
                self._judge(entry, exc)
                rejected.add((entry.step, entry.tier.name))
                continue
            finally:
                timings["read_s"] += time.monotonic() - began
            # where this rank's bytes came from, for the goodput ledger (a recovery from peers shows as such)
            read = entry.near.read if isinstance(entry.near, NearCopies) else {}
            restored.timings = timings | {f"from_{place}_bytes": float(size) for place, size in read.items()}
            if step is None:
                self._say_unmanifested(entry.step)
            return restored

    def _say_unmanifested(self, resumed: int | None) -> None:
        """Rank 0, after a resume of the newest checkpoint at ``resumed`` (None: none was found): one line for the
        durable step folders newer than it that hold files but no manifest. Nothing commits them, so they were
        skipped; but their files say a checkpoint was there: its manifest was deleted, or its upload never
        finished."""
        if self.rank == 0 and (note := unmanifested_note(self._unmanifested, resumed)) is not None:
            log.warning("%s", note)

    def _judge(self, entry: catalog.Entry, failure: CheckpointError) -> None:
        """Say why a copy whose read failed is skipped, and set it aside only on evidence that it is damaged."""
        if isinstance(failure, CorruptCheckpointError):
            self._warn(f"Skipping {entry.where()}: {failure}; trying an older checkpoint", depth=1)
            self._take_out(entry, definitely_corrupt=True)
        elif isinstance(failure, UncheckedReadError):
            self._warn(
                f"Skipping {entry.where()}: {failure}; {self._recheck(entry)}; trying an older checkpoint", depth=1
            )
        else:
            self._warn(
                f"Skipping {entry.where()} for now: {failure}; it stays in place; trying an older checkpoint", depth=1
            )

    def load_entry(
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
                group=self.control.group,
                allow_pickle=allow_pickle,
                check_reads=not self._hashes_before_load(entry),
                read=counter,
            )

        self.control.agree(plan)
        counter = ReadCounter()
        size = f"{entry.manifest.total_bytes / 2**30:.2f} GiB" if entry.manifest is not None else "size unknown"
        what = f"reading step {entry.step} from the {entry.tier.name} tier ({size})"

        def done() -> str:
            return f"{counter.bytes / 2**30:.2f} GiB read on this rank"

        with still_going(what, enabled=self.rank == 0, detail=done):
            self.control.agree(read)
        restored: Restored = box["restored"]
        return restored

    def _nearer(self, entry: catalog.Entry) -> catalog.Entry:
        """A durable entry with the copies of its files held nearer: those this node's disk holds unchanged (with
        ``verify="auto"``, known so by this node's proofs where they hold), then those in peers' memory."""
        if entry.tier is self.local or entry.manifest is None:
            return entry
        where = self.local.step_path(entry.step)
        proofs = Proofs(where) if self.config.verify == "auto" else None
        files = {f.path: f for f in entry.manifest.files}
        peers = PeerCopies(list(self.peer_servers), entry.manifest, entry.step) if self.peer_servers else None
        return replace(
            entry, near=NearCopies(files, entry.tier.name, LocalCopy(self.local, where, files, proofs), peers)
        )

    def _choose(
        self, step: int | None, rejected: set[tuple[int, str]] | None = None, timings: dict[str, float] | None = None
    ) -> catalog.Entry | None:
        """The newest copy that verifies (of ``step``), not ``rejected``; adds to ``timings``' discovery and
        verification seconds."""
        spent = timings if timings is not None else dict.fromkeys(LOAD_PARTS, 0.0)

        def listed() -> list[tuple[str, int, str, Any, str | None]]:
            found = [e for tier in (self.local, self.durable) if tier is not None for e in catalog.scan(tier)]
            self._unmanifested = [e for e in found if e.tier is self.durable and e.problem == catalog.NOT_COMMITTED]
            return [
                (e.tier.name, e.step, e.path, e.manifest, e.problem)
                for e in catalog.ranked(found, invalid=True)
                if (step is None or e.step == step) and (e.step, e.tier.name) not in (rejected or set())
            ]

        # Rank 0 lists once; every rank verifies a share of the files, so a full check scales with ranks.
        tiers: dict[str, Tier | None] = {"local": self.local, "durable": self.durable}
        began = time.monotonic()
        entries = [
            self._nearer(catalog.Entry(s, tier, path, manifest, problem))
            for name, s, path, manifest, problem in self.control.decide(listed)
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

    def _recheck(self, entry: catalog.Entry) -> str:
        """After a read failed with no evidence either way: every file of the copy hashed against its manifest
        (no proofs taken), on every rank's share. Only a mismatch sets the copy aside; what the check found."""
        problem = self._verify_together(entry, (self.rank, self.world_size), recheck=True)
        if problem is None:
            return "every file matches its manifest, so the copy stays in place"
        return f"checking it against its manifest: {problem}"

    def _verify_together(self, entry: catalog.Entry, share: tuple[int, int], *, recheck: bool = False) -> str | None:
        """Every rank checks its share; a problem anywhere rejects the copy everywhere. Only a copy that does not
        match its manifest is set aside: a check that could not finish (storage that did not answer) proves
        nothing. ``recheck``: every file hashed, nothing taken on trust."""
        full = recheck or self._hashes_before_load(entry)
        local = self.config.verify == "auto" and entry.tier is self.local
        proven = Proofs(entry.path) if local and not recheck else None
        checked = replace(entry, near=None) if recheck else entry
        try:
            self.control.agree(lambda: catalog.verify(checked, full=full, share=share, proven=proven))
        except CorruptCheckpointError as exc:
            self._take_out(entry, definitely_corrupt=True)
            return str(exc)
        except CheckpointError as exc:
            return str(exc)
        except Exception as exc:
            return describe(exc)
        return None

    def _take_out(self, entry: catalog.Entry, *, definitely_corrupt: bool) -> None:
        """Take a corrupt copy out of discovery without deleting it, so its step can be saved again; never once a
        stop began (whatever failed then may have failed because of it)."""
        leaving.leave_if_decided()
        if definitely_corrupt:
            self.roots.forget(entry.step)
        if self.rank == 0 and definitely_corrupt:
            _quarantine(entry)
        self.control.barrier()

    def _warn(self, message: str, depth: int = 0) -> None:
        """Rank 0 warns, at the caller of :meth:`CheckpointManager.load` (``depth``: calls between here and this
        class's public method)."""
        if self.rank == 0:
            warnings.warn(message, stacklevel=4 + depth)


def _quarantine(entry: catalog.Entry) -> None:
    """A local copy moves to ``<local_root>/quarantine/``; in an object store, where moving a prefix is a copy of
    every object, only its manifest is renamed."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    try:
        if isinstance(entry.tier, LocalTier):
            aside = entry.tier.path(QUARANTINE_DIR, aside_name(entry.step, stamp))
            entry.tier.rename(entry.path, aside)
        else:
            assert isinstance(entry.tier, DurableTier)
            aside = f"{entry.path}/{CORRUPT_MANIFEST}{stamp}"
            entry.tier.rename(f"{entry.path}/{MANIFEST}", aside)
        log.warning("quarantined corrupt %s as %s", entry.where(), entry.tier.display(aside))
    except Exception as exc:
        log.warning("could not quarantine %s: %s", entry.where(), exc)


@dataclass
class _SetAside:
    """A copy taken out of discovery as corrupt: its step, where it is now, how to put it back, and its root."""

    step: int
    where: str
    back: str
    root: str


def set_aside_note(local: LocalTier, durable: DurableTier | None) -> str | None:
    """One line for a run that starts from step 0 while copies set aside as corrupt exist: which steps, where, and
    how to put one back. None when there are none (or they cannot be listed: the note must not stop a start)."""
    found: list[_SetAside] = []
    try:
        for path in local.fs.ls(local.path(QUARANTINE_DIR), detail=False):
            step = parse_step_dirname(str(path).rstrip("/").rsplit("-", 1)[0])
            if step is not None:
                found.append(_SetAside(step, str(path), f"mv {path} {local.step_path(step)}", local.root))
    except OSError:
        pass
    try:
        for entry in catalog.scan(durable) if durable is not None else []:
            names = [] if entry.committed else [n for n in entry.tier.file_sizes(entry.path) if CORRUPT_MANIFEST in n]
            if names:
                moved = entry.tier.display(f"{entry.path}/{max(names)}")
                found.append(
                    _SetAside(entry.step, moved, f"rename {moved} to {MANIFEST}", entry.tier.display(entry.tier.root))
                )
    except OSError:
        pass
    if not found:
        return None
    found.sort(key=lambda item: -item.step)
    steps = ", ".join(str(item.step) for item in found[:8]) + (" and more" if len(found) > 8 else "")
    newest = found[0]
    return (
        f"no committed checkpoint verifies, so this run starts from step 0, while steps {steps} are set aside as "
        f"corrupt (in {local.path(QUARANTINE_DIR)}, or as durable manifests renamed {CORRUPT_MANIFEST}<time>). If "
        f"one is sound, put it back before training on, e.g. step {newest.step}: {newest.back}, then run "
        f"`resilience verify {newest.root} --step {newest.step}`"
    )


def unmanifested_note(entries: list[catalog.Entry], resumed: int | None) -> str | None:
    """One line naming the durable step folders newer than ``resumed`` (None: every one) that hold files but no
    manifest (nor one set aside as corrupt or superseded, which other lines tell of); None when there are none,
    or they cannot be listed (the line must not stop a resume)."""
    found: list[str] = []
    for entry in sorted(entries, key=lambda e: -e.step):
        if resumed is not None and entry.step <= resumed:
            continue
        try:
            names = entry.tier.file_sizes(entry.path)
        except OSError:
            continue
        if not names or any(name.startswith(MANIFEST) for name in names):
            continue
        why = "its upload never finished" if WRITER_FILE in names else "its manifest.json was deleted"
        found.append(f"step {entry.step} ({entry.tier.display(entry.path)}: {len(names)} files, no manifest; {why}?)")
    if not found:
        return None
    since = f"resumed from step {resumed}" if resumed is not None else "starts from step 0"
    return (
        f"the durable tier holds {'; '.join(found)}: skipped, as only a manifest commits a checkpoint; this run "
        f"{since}. A node whose local tier still holds such a step can put it back: `resilience upload "
        "LOCAL_ROOT DURABLE_URL --step N`"
    )


def settle_own_save(handle: SaveHandle | None, wait: Callable[[], object]) -> None:
    """This process's last save (``handle``) is the newest state it knows: a load waits (``wait``) for its local
    commit, so that a load right after a save (a rollback) reads it rather than an older checkpoint; a failed save
    raises."""
    if handle is None or handle.committed.done():
        return
    log.info("waiting for the save of step %d to commit before loading", handle.step)
    try:
        wait()
    except CheckpointError as exc:
        raise CheckpointError(
            f"load: the save of step {handle.step} made before it did not commit ({exc}); to load the newest "
            "committed checkpoint instead, pass its step"
        ) from exc
