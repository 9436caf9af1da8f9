"""A node's record that a local file is still the one it hashed when it committed it.

A resume on the node that wrote a checkpoint would otherwise hash every local shard again (``verify="auto"``),
though nothing has touched them since. At commit each rank stats the files it hashed and writes what it saw,
with the checksum, to ``.proof-<rank>.json`` in the step directory (local tier only, never uploaded). A later
check takes a file as verified without reading it when its device, inode, size, modification and change times
are all unchanged and the recorded checksum is the manifest's.

What that proves: the file was not written, truncated, replaced or renamed over through the file system since
it was hashed (any of those sets a new change time, which no system call can set back). What it does not: a
bit flipped on the medium or in memory underneath the file system, which only reading the bytes finds; hence
``verify="full"`` ignores proofs. A file changed within one clock tick of its stat could keep its change time,
so a file whose change time is that close to the proof's own time is hashed again, as git treats a "racily
clean" index entry; the writer waits out that tick before it records the proof, so its own fresh files hold.
A proof is read as untrusted JSON: anything malformed or missing only means hashing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from resilience.persist.direct_io import Written
from resilience.storage.layout import proof_file
from resilience.storage.manifest import FileEntry, hash_stream

log = logging.getLogger(__name__)

VERSION = 1
# A change within this long of the stat could share its change time (file-system timestamps come from a clock
# that ticks every 1-10 ms on Linux): such a file is hashed again rather than trusted.
RACY_NS = 20_000_000
_FIELDS = ("dev", "ino", "size", "mtime_ns", "ctime_ns")


@dataclass(frozen=True)
class Seen:
    """A file's identity and times as its writer saw them, with the checksum it computed."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    xxh3_64: str

    @classmethod
    def of(cls, path: str, xxh3_64: str) -> Seen:
        return cls.from_stat(os.stat(path), xxh3_64)

    @classmethod
    def from_stat(cls, st: os.stat_result, xxh3_64: str) -> Seen:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, xxh3_64)


def hashed(
    directory: str, rank: int, names: Sequence[tuple[str, str]], known: Mapping[str, Written] | None = None
) -> list[FileEntry]:
    """The manifest entries of rank ``rank``'s files in ``directory`` (``(name, kind)`` pairs), and the proof of
    what was hashed recorded beside them. A file in ``known`` (hashed by its writer as it wrote it) is taken
    from there, unless its size on disk is not the writer's; any other is read and hashed."""
    known = known or {}
    entries, seen = [], {}
    for name, kind in names:
        path = os.path.join(directory, name)
        written = known.get(name)
        if written is not None and os.stat(path).st_size == written.size:
            digest, size = written.xxh3_64, written.size
            seen[name] = Seen.from_stat(written.stat, digest)
        else:
            with open(path, "rb") as stream:
                digest, size = hash_stream(stream)
        entries.append(FileEntry(name, size, digest, rank, kind))
    record(directory, rank, entries, seen)
    return entries


def record(directory: str, rank: int, entries: Iterable[FileEntry], seen: Mapping[str, Seen] | None = None) -> None:
    """Write rank ``rank``'s proof for ``entries`` (files of ``directory`` it has just hashed; ``seen``: those
    its writer stat-ed itself as it finished them). Best effort, and not synced: a proof lost or torn in a
    crash only means the next resume hashes these files."""
    seen = seen or {}
    try:
        stats = {e.path: seen.get(e.path) or Seen.of(os.path.join(directory, e.path), e.xxh3_64) for e in entries}
        files = {name: asdict(stat) for name, stat in _past_the_tick(directory, stats).items()}
        body = json.dumps({"version": VERSION, "recorded_ns": time.time_ns(), "files": files}).encode()
        path = os.path.join(directory, proof_file(rank))
        with open(path, "wb") as out:
            out.write(body)
    except OSError as exc:
        log.debug("no proof written for rank %d in %s: %s", rank, directory, exc)


def _past_the_tick(directory: str, stats: dict[str, Seen]) -> dict[str, Seen]:
    """The files of ``stats`` still as they were, once a clock tick has passed since the newest change among them.

    A reader trusts no proof recorded within a tick of its file's last change (:data:`RACY_NS`), and a commit
    records its proof right after its writes: without waiting, the proof of the shards just written would hardly
    ever hold, and every resume would hash them again. So the recorder waits out the tick (at most ``RACY_NS``,
    in the writer, off the training thread) and stats each file again: any change from then on sets a change time
    the proof does not hold. A file that changed meanwhile (something else wrote it) is left out: it is hashed.
    """
    newest = max((max(seen.ctime_ns, seen.mtime_ns) for seen in stats.values()), default=0)
    longest = RACY_NS + 1_000_000  # 1 ms more: the reader's comparison is strict
    wait_ns = min(newest + longest - time.time_ns(), longest)  # a time ahead of this clock only costs a hash
    if wait_ns <= 0:
        return stats
    time.sleep(wait_ns / 1e9)
    kept = {}
    for name, seen in stats.items():
        try:
            if Seen.of(os.path.join(directory, name), seen.xxh3_64) == seen:
                kept[name] = seen
        except OSError:
            continue
    return kept


class Proofs:
    """The proofs of one step directory, each read once when first needed; :meth:`holds` says whether a file may
    skip its hash. A file is vouched for only by the proof of the rank the manifest says wrote it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._by_rank: dict[int, dict[str, Seen]] = {}

    def holds(self, item: FileEntry) -> bool:
        """``item`` (the manifest's entry) is still the file that was hashed to its checksum."""
        if item.rank not in self._by_rank:
            self._by_rank[item.rank] = _read(os.path.join(self.directory, proof_file(item.rank)))
        seen = self._by_rank[item.rank].get(item.path)
        if seen is None or seen.xxh3_64 != item.xxh3_64 or seen.size != item.size:
            return False
        try:
            now = Seen.of(os.path.join(self.directory, item.path), item.xxh3_64)
        except OSError:
            return False
        return now == seen


def _read(path: str) -> dict[str, Seen]:
    """The files a proof vouches for; nothing for a proof that is missing or malformed (hashing, not trust)."""
    try:
        with open(path, "rb") as stream:
            data = json.loads(stream.read(16 << 20))
        if not isinstance(data, dict) or data.get("version") != VERSION:
            return {}
        recorded, files = data["recorded_ns"], data["files"]
        if type(recorded) is not int:
            return {}
        found = {}
        for name, fields in files.items():
            if not isinstance(name, str) or not isinstance(fields, dict):
                return {}
            numbers = {key: fields[key] for key in _FIELDS}
            digest = fields["xxh3_64"]
            if any(type(n) is not int for n in numbers.values()) or type(digest) is not str:
                return {}
            seen = Seen(**numbers, xxh3_64=digest)
            if seen.ctime_ns < recorded - RACY_NS and seen.mtime_ns < recorded - RACY_NS:
                found[name] = seen
        return found
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return {}
