"""Finding checkpoints in the tiers and deciding which ones can be trusted.

A checkpoint is a candidate only with a manifest; it is trusted only once every file the manifest lists is
present at its size, and the checksums that the chosen level asks for match. Anything else is skipped with
the reason, and the next older checkpoint is tried.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol

from resilience.errors import CorruptCheckpointError, NoCheckpointError
from resilience.storage.layout import MANIFEST, parse_step_dirname
from resilience.storage.manifest import FileEntry, Manifest, hash_stream
from resilience.storage.proofs import Proofs
from resilience.storage.tiers import DurableTier, LocalTier, Tier

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
NOT_COMMITTED = "not committed (no manifest)"


class NearerCopies(Protocol):
    """Where a load finds a checkpoint's files nearer than its tier (:class:`~resilience.storage.dcp_fs.NearCopies`)."""

    def holds(self, name: str) -> bool:
        """Whether the file is held nearer (its bytes are checked again when :meth:`open` reads them)."""

    def vouched_for(self, name: str) -> bool:
        """Whether :meth:`holds` said yes for the file: discovery then did not check the tier's copy, so if
        :meth:`open` cannot deliver it after all, the tier's bytes must be checked as they are read."""

    def open(self, name: str) -> IO[bytes] | None:
        """The file, unchanged from what the manifest lists, or None if it is not held nearer."""

    def describe(self) -> str | None:
        """What was read nearer, for the load's log line (None if nothing was)."""


@dataclass
class Entry:
    """One ``step-<N>`` directory in one tier; ``manifest`` is None when it is not (validly) committed.
    ``near``: for a load, copies of its files held nearer than its tier (this node's disk, a peer's memory)."""

    step: int
    tier: Tier
    path: str
    manifest: Manifest | None
    problem: str | None = None
    near: NearerCopies | None = None

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    def where(self) -> str:
        return f"step {self.step} in the {self.tier.name} tier ({self.tier.display(self.path)})"


def scan(tier: Tier) -> list[Entry]:
    """Every step directory of ``tier``, newest first, with its manifest parsed and validated."""
    entries = []
    for step, path in sorted(tier.list_steps().items(), reverse=True):
        manifest_path = f"{path}/{MANIFEST}"
        try:
            data = tier.read_bytes(manifest_path)
        except FileNotFoundError:
            entries.append(Entry(step, tier, path, None, NOT_COMMITTED))
            continue
        try:
            manifest = Manifest.from_json(data, where=tier.display(manifest_path), expected_step=step)
        except CorruptCheckpointError as exc:
            entries.append(Entry(step, tier, path, None, str(exc)))
            continue
        entries.append(Entry(step, tier, path, manifest))
    return entries


ROOTS_BELOW_DEPTH = 3


def roots_below(tier: Tier, *, depth: int = ROOTS_BELOW_DEPTH, max_listings: int = 200) -> list[tuple[str, int]]:
    """Folders below ``tier``'s root, ``depth`` levels down at most, that hold committed ``step-<N>`` folders,
    as (path, number of committed steps), nearest first.

    A user who names the run's folder rather than its checkpoint root (``resilience ls RUN`` for ``RUN/ckpt``)
    is told where the checkpoints are. Hidden and step folders are not entered, and at most ``max_listings``
    folders are listed, so a search from a home directory or a bucket's top stays short.
    """
    found: list[tuple[str, int]] = []
    level, listings = [tier.root], 0
    for _ in range(depth + 1):
        deeper: list[str] = []
        for folder in level:
            if listings >= max_listings:
                return found
            listings += 1
            try:
                children = sorted(
                    str(e["name"]).rstrip("/") for e in tier.fs.ls(folder, detail=True) if e.get("type") == "directory"
                )
            except OSError:  # unreadable or gone: nothing to suggest there
                continue
            steps = [c for c in children if parse_step_dirname(c) is not None]
            committed = sum(1 for step in steps if tier.fs.exists(f"{step}/{MANIFEST}"))
            if committed and folder != tier.root:
                found.append((tier.display(folder), committed))
            deeper += [c for c in children if c not in steps and not c.rsplit("/", 1)[-1].startswith(".")]
        level = deeper
    return found


def open_root(text: str, options: dict[str, Any] | None = None) -> tuple[Tier, int | None]:
    """A checkpoint root a user named (a directory or an fsspec URL) as (tier, step): a ``step-<N>`` folder
    stands for step N of its parent root; ``step`` is None for a root."""
    options = options or {}
    text = text.rstrip("/")
    step = parse_step_dirname(text)
    if step is not None and _is_step_dir(text, options):
        return _existing_tier(text.rsplit("/", 1)[0] or "/", options), step
    return _existing_tier(text, options), None


def _existing_tier(root: str, options: dict[str, Any]) -> Tier:
    tier: Tier = DurableTier(root, options, setting="ROOT") if "://" in root else LocalTier(root, setting="ROOT")
    tier.check_readable()
    if not tier.exists(tier.root):
        raise NoCheckpointError(
            f"{root} does not exist: give a checkpoint root (the local_root or durable_url of a run)"
        )
    return tier


def _is_step_dir(path: str, options: dict[str, Any]) -> bool:
    """A ``step-<N>`` folder itself (not a root that happens to be named like one: it would hold step dirs)."""
    if "://" in path:
        tier = DurableTier(path, options, setting="ROOT")
        return tier.exists(f"{tier.root}/{MANIFEST}") or not tier.list_steps()
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, MANIFEST)) or not LocalTier(path).list_steps())


def verify(
    entry: Entry,
    *,
    full: bool,
    share: tuple[int, int] = (0, 1),
    progress: Progress | None = None,
    proven: Proofs | None = None,
) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``entry``'s files match its manifest.

    Sizes are always checked; checksums of the small pickled/JSON files always, those of shards when
    ``full``. ``share=(i, n)`` checksums only every n-th file starting at i, so ranks can split the work.
    A shard that ``proven`` holds (this node hashed it at commit and nothing has touched it since) is not hashed,
    nor a file held nearer (``entry.near``), whose bytes a load reads there and checks as it reads them.
    """
    if entry.manifest is None:
        raise CorruptCheckpointError(f"{entry.where()} is {entry.problem}", step=entry.step, tier=entry.tier.name)
    found = damage(entry)
    if found is not None:
        raise _corrupt(entry, *found)
    to_hash = [item for item in entry.manifest.files if full or item.kind != "shard"]
    mine = to_hash[share[0] :: share[1]]
    done = 0
    for item in mine:
        if entry.near is not None and entry.near.holds(item.path):
            pass
        elif not (proven is not None and item.kind == "shard" and proven.holds(item)):
            check_file(entry, item)
        done += item.size
        if progress is not None:
            progress(done, sum(i.size for i in mine))


def damage(entry: Entry) -> tuple[FileEntry, str] | None:
    """The first file of a committed entry's manifest that its tier lacks or holds at another size, and what is
    wrong with it; None when every file is there at its size. One listing: cheap enough for ``resilience ls``
    and for checking a durable copy before it is trusted or healed (a lifecycle rule or a person may have
    deleted files under a manifest, or an upload cut short may have left one short)."""
    assert entry.manifest is not None
    sizes = entry.tier.file_sizes(entry.path)
    for item in entry.manifest.files:
        if item.path not in sizes:
            return item, "is missing"
        if sizes[item.path] != item.size:
            return item, f"is {sizes[item.path]} bytes, the manifest says {item.size}"
    return None


def check_file(entry: Entry, item: FileEntry, copy_to: IO[bytes] | None = None) -> None:
    """The file's size and checksum match the manifest, or :class:`CorruptCheckpointError`; with ``copy_to``, the
    bytes checked are also written there as they are read."""
    with entry.tier.open(f"{entry.path}/{item.path}") as stream:
        digest, size = hash_stream(stream, copy_to)
    check_hashed(entry, item, digest, size)


def check_hashed(entry: Entry, item: FileEntry, digest: str, size: int) -> None:
    """The checksum and length of a file's bytes as read match the manifest, or :class:`CorruptCheckpointError`."""
    if size != item.size:
        raise _corrupt(entry, item, f"reads {size} bytes, the manifest says {item.size}")
    if digest != item.xxh3_64:
        raise _corrupt(entry, item, f"has checksum {digest}, the manifest says {item.xxh3_64}")


def _corrupt(entry: Entry, item: FileEntry, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{entry.where()}: file {item.path} {what}",
        step=entry.step,
        tier=entry.tier.name,
        path=item.path,
    )


def candidates(tiers: Iterable[Tier | None], *, invalid: bool = False) -> list[Entry]:
    """Committed, loadable entries of all tiers, newest step first; the local tier first within a step.

    A local-tier manifest written for one node's part only (node-local disks) is not loadable by itself.
    With ``invalid``, entries whose manifest is there but invalid come too (with their ``problem``): resume
    must report and set them aside like corrupt files, or their step could never be saved again.
    """
    return ranked([entry for tier in tiers if tier is not None for entry in scan(tier)], invalid=invalid)


def ranked(found: Iterable[Entry], *, invalid: bool = False) -> list[Entry]:
    """:func:`candidates` among entries already scanned."""
    usable = [
        e
        for e in found
        if (e.manifest is not None and e.manifest.is_global)
        or (invalid and e.manifest is None and e.problem != NOT_COMMITTED)
    ]
    order = {"local": 0, "durable": 1}
    return sorted(usable, key=lambda e: (-e.step, order.get(e.tier.name, 2)))


def first_verified(
    entries: Sequence[Entry],
    check: Callable[[Entry], str | None],
    warn: Callable[[str], None],
) -> Entry | None:
    """The first entry ``check`` finds no problem with; each rejection is reported through ``warn``."""
    for index, entry in enumerate(entries):
        problem = check(entry)
        if problem is None:
            return entry
        after = next((e for e in entries[index + 1 :]), None)
        fallback = f"trying {after.where()}" if after else "no older committed checkpoint is left"
        warn(f"Skipping {entry.where()}: {problem}; {fallback}")
    return None
