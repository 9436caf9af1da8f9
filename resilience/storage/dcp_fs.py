"""DCP's file-system interface over a :class:`~resilience.storage.tiers.Tier`: DCP writes and reads checkpoints
through the same tier objects the engine lists, checks, uploads and retires them with.

:class:`TierFileSystem` is each of DCP's file operations as the tier's; the two kinds DCP is given add one thing
each: :class:`HashedFileSystem` (a save's writer) makes new files the local tier's hashed streams, and
:class:`LoadFileSystem` (a load's reader) reads each file from the nearest place that holds it
(:class:`NearCopies`). It lives apart from :mod:`resilience.storage.tiers` because importing
``torch.distributed.checkpoint`` takes seconds: ``resilience ls`` and ``verify`` read checkpoints through tiers
and need none of DCP.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from resilience.persist import direct_io
from resilience.persist.direct_io import Written
from resilience.progress import size_text
from resilience.storage.catalog import Entry, check_file
from resilience.storage.manifest import FileEntry, hash_stream
from resilience.storage.peer_copies import PeerCopies
from resilience.storage.proofs import Proofs
from resilience.storage.tiers import LocalTier, Tier

PathLike = str | os.PathLike[str]


class TierFileSystem(FileSystemBase):
    """DCP's ``FileSystemBase``, every operation the tier's; paths are the tier's own strings (DCP joins them)."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier

    @contextmanager
    def create_stream(self, path: PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        with self.tier.open(os.fspath(path), mode) as stream:
            yield stream  # type: ignore[misc]

    def concat_path(self, path: PathLike, suffix: str) -> str:
        return f"{os.fspath(path)}/{suffix}"

    def init_path(self, path: PathLike) -> str:
        return os.fspath(path)

    def rename(self, path: PathLike, new_path: PathLike) -> None:
        self.tier.rename(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: PathLike) -> None:
        self.tier.makedirs(os.fspath(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: PathLike) -> bool:
        return True

    def exists(self, path: PathLike) -> bool:
        return self.tier.exists(os.fspath(path))

    def rm_file(self, path: PathLike) -> None:
        self.tier.remove_file(os.fspath(path))


# ---- writing ------------------------------------------------------------------------------------------------


class HashedFileSystem(TierFileSystem):
    """A save's files, written as the local tier's hashed streams (:meth:`LocalTier.open_hashed`); :attr:`written`
    maps each finished file's name (relative to its folder) to its :class:`Written`. The entries' zip records
    carry no CRC-32 (:func:`resilience.persist.direct_io._no_zip_crcs`)."""

    tier: LocalTier

    def __init__(self, tier: LocalTier, *, direct: bool, fsync: bool) -> None:
        super().__init__(tier)
        self.direct = direct
        self.fsync = fsync
        self.written: dict[str, Written] = {}

    @contextmanager
    def create_stream(self, path: PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))

        def done(written: Written) -> None:
            self.written[name] = written

        stream = self.tier.open_hashed(os.fspath(path), done, direct=self.direct, fsync=self.fsync)
        try:
            # DCP writes every entry of the file inside this block, in this thread
            with direct_io._no_zip_crcs():
                yield stream
        except BaseException:
            stream.abandon()
            raise
        finally:
            stream.close()


# ---- reading ------------------------------------------------------------------------------------------------


@dataclass
class LocalCopy:
    """The files of a durable checkpoint that this node's local tier still holds unchanged.

    On node-local disks no local copy is complete (each node holds its own ranks' files), so a resume loads
    the durable checkpoint; after a whole-job restart, though, the shards a node wrote are still on its disk,
    and reading them there spares the durable tier (and the network) most of the load. A file counts only if
    its size and checksum match the durable manifest: another save of the same step (an abandoned branch, a
    crashed attempt) must not load as this one; with ``proofs``, a file this node hashed to that checksum at
    commit and that nothing has touched since counts without hashing it again. Anything else is read from the
    durable tier.
    """

    tier: Tier
    path: str
    files: dict[str, FileEntry]
    proofs: Proofs | None = None
    checked: dict[str, bool] = field(default_factory=dict)

    def holds(self, name: str) -> bool:
        if name not in self.checked:
            self.checked[name] = self._matches(name)
        return self.checked[name]

    def _matches(self, name: str) -> bool:
        item = self.files.get(name)
        if item is None:
            return False
        if self.proofs is not None and self.proofs.holds(item):
            return True
        try:
            with self.tier.open(f"{self.path}/{name}") as stream:
                digest, size = hash_stream(stream)
        except OSError:
            return False
        return size == item.size and digest == item.xxh3_64


HASHED_AS_READ = "rb, hashed as read"  # LoadFileSystem.create_stream's mode for a reader that checks as it reads
SPOOL_BYTES = 64 << 20  # a checked copy stays in memory up to this size, then goes to a temporary file


@contextmanager
def _checked_copy(entry: Entry, item: FileEntry) -> Generator[IO[bytes], None, None]:
    """The file, read once into a private copy and checked against its manifest entry before DCP parses any of it.

    For shards whose checksum was not verified before the load (``verify="auto"`` checks the durable tier's by
    size, since hashing them first would download each twice): the copy is what DCP reads, so the bytes checked
    are the bytes loaded, and corrupt ones never are.
    """
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as copy:
        check_file(entry, item, copy_to=copy)
        copy.seek(0)
        yield copy


class ReadCounter:
    """Bytes read so far by a load, for a progress line (read from another thread: an int is enough)."""

    def __init__(self) -> None:
        self.bytes = 0


class _Counted(io.RawIOBase):
    """A stream whose reads add to a :class:`ReadCounter`; everything else goes to the stream."""

    def __init__(self, stream: Any, read: ReadCounter):
        self.stream = stream
        self.counter = read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self.stream.seekable())

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self.stream.seek(offset, whence))

    def tell(self) -> int:
        return int(self.stream.tell())

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.counter.bytes += len(data)
        return bytes(data)

    def readinto(self, buffer: Any) -> int:
        count = int(self.stream.readinto(buffer))
        self.counter.bytes += count
        return count


@dataclass
class NearCopies:
    """Where a load reads a durable checkpoint's files before the durable tier: this node's disk (``local``), then
    a peer node's memory (``peers``, :mod:`resilience.storage.peer_copies`); each only where it holds the file
    unchanged from the manifest (``files``). :attr:`read` adds up the bytes opened in each place (``"disk"``,
    ``"peers"``, the tier's name), for the log and the goodput ledger."""

    files: dict[str, FileEntry]
    tier: str
    local: LocalCopy | None = None
    peers: PeerCopies | None = None
    read: dict[str, int] = field(default_factory=dict)
    vouched: set[str] = field(default_factory=set)

    def holds(self, name: str) -> bool:
        held = (self.local is not None and self.local.holds(name)) or (
            self.peers is not None and self.peers.holds(name)
        )
        if held:
            self.vouched.add(name)
        return held

    def vouched_for(self, name: str) -> bool:
        return name in self.vouched

    def open(self, name: str) -> IO[bytes] | None:
        stream: IO[bytes] | None = None
        place = self.tier
        if self.local is not None and self.local.holds(name):
            stream, place = self.local.tier.open(f"{self.local.path}/{name}"), "disk"
        elif self.peers is not None and (stream := self.peers.fetch(name)) is not None:
            place = "peers"
        item = self.files.get(name)
        self.read[place] = self.read.get(place, 0) + (item.size if item is not None else 0)
        return stream

    def describe(self) -> str | None:
        """Where the files came from, for the load's log line (None if all from the tier)."""
        if set(self.read) <= {self.tier}:
            return None
        where = {"disk": "this node's disk", "peers": "peers' memory", self.tier: f"the {self.tier} tier"}
        return "read " + ", ".join(f"{size_text(size)} from {where[p]}" for p, size in self.read.items())


class LoadFileSystem(TierFileSystem):
    """A load's files, read-only: those held nearer (``entry.near``) from there; else with ``check``, or where
    discovery passed the tier's copy over for a nearer one that then failed, each checked whole before DCP parses
    it (:func:`_checked_copy`), else straight from the tier; ``read`` counts the bytes as they come."""

    def __init__(self, entry: Entry, *, check: bool, read: ReadCounter | None = None):
        super().__init__(entry.tier)
        self.entry = entry
        self.check = check
        self.read = read

    @contextmanager
    def create_stream(self, path: PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        """``mode`` ``"rb"``: the file as the class says. :data:`HASHED_AS_READ`: a file :meth:`due` names, from the
        tier and not checked first, for a reader that hashes every byte as it reads it and compares the sum with the
        manifest before it uses any (:mod:`resilience.checkpoint.hashed_read`)."""
        if mode not in ("rb", HASHED_AS_READ):
            raise ValueError("checkpoint tiers are opened read-only while loading")
        entry = self.entry
        name = self._name(path)
        opened: Any = entry.near.open(name) if entry.near is not None else None
        if opened is None and mode == "rb" and (item := self._check_due(name)) is not None:
            opened = _checked_copy(entry, item)
        elif opened is None:
            opened = self.tier.open(os.fspath(path))
        with opened as stream:
            yield stream if self.read is None else _Counted(stream, self.read)

    def due(self, path: PathLike) -> FileEntry | None:
        """The manifest entry that the tier's copy of ``path`` must be checked against as this load reads it; None
        when it is read nearer (checked there), or unchecked."""
        name = self._name(path)
        if self.entry.near is not None and self.entry.near.holds(name):
            return None
        return self._check_due(name)

    def _check_due(self, name: str) -> FileEntry | None:
        near = self.entry.near
        if self.check or (near is not None and near.vouched_for(name)):
            return self.entry.manifest.file(name)  # type: ignore[union-attr]
        return None

    def _name(self, path: PathLike) -> str:
        return os.fspath(path).removeprefix(f"{self.entry.path}/")

    def rename(self, path: PathLike, new_path: PathLike) -> None:
        raise NotImplementedError

    def mkdir(self, path: PathLike) -> None:
        raise NotImplementedError

    def rm_file(self, path: PathLike) -> None:
        raise NotImplementedError
