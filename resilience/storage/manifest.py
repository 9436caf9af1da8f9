"""The commit record of a checkpoint: a JSON manifest written last, after every rank's files are in place.

A manifest is also the one thing read from storage before anything else, so it is validated as hostile
input: its paths must stay inside the checkpoint directory, its numbers must be sane, its types exact.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any, TypeGuard

import xxhash

from resilience.errors import CorruptCheckpointError
from resilience.storage.layout import PACKS_FILE

FORMAT = "training-resilience/checkpoint"
# 1: every tensor is a DCP entry of its own. 2: small tensors may be packed (a "packs" file, packs.json). A manifest
# states the lowest version its checkpoint needs, so one without packs stays readable by releases reading only 1.
VERSION = 2
PACKED_VERSION = 2
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILE_BYTES = 1 << 50
FILE_KINDS = ("shard", "dcp-metadata", "state", "packs")
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_HEX64 = re.compile(r"^[0-9a-f]{16}$")
_RUN_ID = re.compile(r"^[0-9a-zA-Z_.-]{1,64}$")
_CHUNK = 8 << 20
_WINDOW = 64 << 20  # a multiple of mmap.ALLOCATIONGRANULARITY


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, relative to its step directory."""

    path: str
    size: int
    xxh3_64: str
    rank: int
    kind: str


@dataclass
class Manifest:
    """What a committed checkpoint holds; see docs/FORMAT.md for the layout."""

    step: int
    world_size: int
    files: list[FileEntry]
    ranks: list[int] | None = None
    created_unix: float = field(default_factory=time.time)
    versions: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    pickled: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    @property
    def is_global(self) -> bool:
        """True when the manifest covers every rank's files (not only one node's part of the local tier)."""
        return self.ranks is None or sorted(self.ranks) == list(range(self.world_size))

    @property
    def version(self) -> int:
        """The lowest format version that can read this checkpoint."""
        return PACKED_VERSION if any(entry.kind == "packs" for entry in self.files) else 1

    def file(self, path: str) -> FileEntry | None:
        return next((entry for entry in self.files if entry.path == path), None)

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "version": self.version, **asdict(self)}
        return json.dumps(body, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str, expected_step: int | None = None) -> Manifest:
        """Parse and validate; every defect raises :class:`CorruptCheckpointError` naming ``where``."""

        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"Manifest {where} is invalid: {why}", step=expected_step)

        if len(data) > MAX_MANIFEST_BYTES:
            raise bad(f"{len(data)} bytes is more than any manifest needs ({MAX_MANIFEST_BYTES})")
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:  # also huge integers and nesting deeper than the parser's stack
            raise bad(f"not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not isinstance(body, dict):
            raise bad("top level is not an object")
        if body.get("format") != FORMAT:
            raise bad(f"format {body.get('format')!r} is not {FORMAT!r}")
        version = body.get("version")
        if not _is_int(version) or not 1 <= version <= VERSION:
            raise bad(f"version {version!r} is not supported by this release (reads 1..{VERSION}); upgrade")
        step = _int_field(body, "step", 0, 1 << 62, bad)
        if expected_step is not None and step != expected_step:
            raise bad(f"step {step} does not match its directory step-{expected_step}")
        world_size = _int_field(body, "world_size", 1, 1 << 24, bad)
        raw_files = body.get("files")
        if not isinstance(raw_files, list) or not raw_files:
            raise bad("'files' is not a non-empty list")
        files = [_parse_file(item, world_size, bad) for item in raw_files]
        if len({entry.path for entry in files}) != len(files):
            raise bad("a file is listed twice")
        packs = [entry for entry in files if entry.kind == "packs"]
        if packs and (version < PACKED_VERSION or len(packs) > 1 or packs[0].path != PACKS_FILE):
            raise bad(f"a 'packs' file must be the one {PACKS_FILE}, in a manifest of version {PACKED_VERSION} or up")
        ranks = body.get("ranks")
        if ranks is not None and (
            not isinstance(ranks, list) or not all(_is_int(r) and 0 <= r < world_size for r in ranks)
        ):
            raise bad("'ranks' is not a list of ranks below world_size")
        run_id = body.get("run_id")
        if run_id is not None and (not isinstance(run_id, str) or not _RUN_ID.match(run_id)):
            raise bad(f"'run_id' is {run_id!r}, not a run id")
        created = body.get("created_unix")
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise bad("'created_unix' is not a number")
        return cls(
            step=step,
            world_size=world_size,
            files=files,
            ranks=ranks,
            created_unix=float(created),
            versions=_str_map(body.get("versions", {}), "versions", bad),
            timings={k: float(v) for k, v in _num_map(body.get("timings", {}), "timings", bad).items()},
            pickled=_str_list(body.get("pickled", []), "pickled", bad),
            extra=body.get("extra", {}) if isinstance(body.get("extra", {}), dict) else {},
            run_id=run_id,
        )


def check_relative_path(path: object) -> str:
    """Accept only plain relative paths below a checkpoint directory (no ``..``, no absolute, no odd bytes)."""
    if not isinstance(path, str) or not _SAFE_PATH.match(path) or any(p in (".", "..") for p in path.split("/")):
        raise ValueError(f"path {path!r} is not a plain relative path inside the checkpoint directory")
    return path


def hash_stream(stream: IO[bytes], copy_to: IO[bytes] | None = None) -> tuple[str, int]:
    """xxh3-64 and length of everything readable from ``stream`` (the hash releases the GIL); with ``copy_to``,
    the bytes are also written there as they are read.

    A regular file opened at its start is hashed through a memory map, window by window: the hash reads the page
    cache in place, where reading copies every byte into a buffer first (several times slower: it is most of
    what verifying a local checkpoint costs). Anything else is read into one reused buffer.
    """
    digest = xxhash.xxh3_64()
    mappable = _mappable(stream)
    if mappable is not None:
        fd, size = mappable
        for offset in range(0, size, _WINDOW):
            with mmap.mmap(fd, min(_WINDOW, size - offset), access=mmap.ACCESS_READ, offset=offset) as window:
                digest.update(window)
                if copy_to is not None:
                    copy_to.write(window)
        stream.seek(size)
        return digest.hexdigest(), size
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    size = 0
    while count := stream.readinto(buffer):  # type: ignore[attr-defined]
        digest.update(view[:count])
        if copy_to is not None:
            copy_to.write(view[:count])
        size += count
    return digest.hexdigest(), size


def _mappable(stream: IO[bytes]) -> tuple[int, int] | None:
    """(descriptor, size) of ``stream`` if it is a regular, non-empty file positioned at its start, else None."""
    try:
        fd = stream.fileno()
        info = os.fstat(fd)
        if stream.tell() != 0 or not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            return None
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None
    return fd, info.st_size


def hash_bytes(data: bytes) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(body: dict[str, Any], name: str, low: int, high: int, bad: Any) -> int:
    value = body.get(name)
    if not _is_int(value) or not low <= value <= high:
        raise bad(f"{name!r} is {value!r}, not an integer in [{low}, {high}]")
    return int(value)


def _parse_file(item: object, world_size: int, bad: Any) -> FileEntry:
    if not isinstance(item, dict):
        raise bad("a file entry is not an object")
    try:
        path = check_relative_path(item.get("path"))
    except ValueError as exc:
        raise bad(str(exc)) from None
    size = _int_field(item, "size", 0, MAX_FILE_BYTES, bad)
    rank = _int_field(item, "rank", 0, world_size - 1, bad)
    digest = item.get("xxh3_64")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise bad(f"checksum of {path} is {digest!r}, not 16 hex digits")
    kind = item.get("kind")
    if kind not in FILE_KINDS:
        raise bad(f"kind of {path} is {kind!r}, not one of {FILE_KINDS}")
    return FileEntry(path=path, size=size, xxh3_64=digest, rank=rank, kind=kind)


def _str_map(value: object, name: str, bad: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise bad(f"{name!r} is not a map of strings")
    return dict(value)


def _num_map(value: object, name: str, bad: Any) -> dict[str, float]:
    if not isinstance(value, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()
    ):
        raise bad(f"{name!r} is not a map of numbers")
    return dict(value)


def _str_list(value: object, name: str, bad: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad(f"{name!r} is not a list of strings")
    return list(value)
