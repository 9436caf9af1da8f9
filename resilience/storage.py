"""Storage tiers: one small interface over fsspec that every backend (local disk, S3, GCS, memory) meets.

A tier is a directory or URL prefix that holds ``step-<N>/`` folders. The engine needs only a handful of
operations from it; the one that matters for correctness is :meth:`Tier.write_exclusive`, which makes a
manifest appear whole and at most once (rename-free link on POSIX, a conditional single PUT on object stores).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import uuid
from collections.abc import Mapping
from typing import IO, Any

import fsspec
from fsspec.callbacks import DEFAULT_CALLBACK, Callback
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from resilience.errors import ConfigError

log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step-(\d+)$")
_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """Storage options with anything that looks like a credential masked, for logs and errors."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            out[name] = redact(value)
        elif any(word in name.lower() for word in _SECRET_WORDS):
            out[name] = "***"
        else:
            out[name] = value
    return out


def step_dirname(step: int) -> str:
    return f"step-{step}"


class Tier:
    """A place checkpoints live, addressed by a local path or an fsspec URL.

    Args:
        name: ``"local"`` or ``"durable"``; used in messages and manifests.
        url: Directory path or fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``file:///...``, ``memory://...``).
        storage_options: Passed to the fsspec filesystem; never shown unredacted.
    """

    def __init__(self, name: str, url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None):
        self.name = name
        url = os.fspath(url)
        options = dict(storage_options or {})
        try:
            fs, root = url_to_fs(url, **options)
        except ValueError as exc:
            known = ", ".join(sorted(p + "://" for p in ("s3", "gs", "file", "memory", "az", "hdfs")))
            raise ConfigError(
                f"Unknown storage URL scheme in {url!r} ({exc}): use a local path or one of {known}, "
                "or install the fsspec backend that provides this scheme"
            ) from exc
        except ImportError as exc:
            raise ConfigError(
                f"The backend for {url!r} is not installed ({exc}): install it, e.g. "
                "`pip install 'training-resilience[s3]'` for s3:// or `[gcs]` for gs://"
            ) from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") or "/"
        self.is_local = isinstance(fs, LocalFileSystem)
        self._options_shown = redact(options)
        self.url = self.root if self.is_local else self._unstrip(self.root)

    def __repr__(self) -> str:
        return f"Tier({self.name!r}, {self.url!r}, storage_options={self._options_shown})"

    def _unstrip(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{path}"

    # ---- paths -------------------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if self.root != "/" else "/" + "/".join(parts)

    def step_path(self, step: int, *parts: str) -> str:
        return self.path(step_dirname(step), *parts)

    def display(self, path: str) -> str:
        return path if self.is_local else self._unstrip(path)

    # ---- checks ------------------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Create the root and prove a file can be written there, so a bad root fails at start-up, not at step N."""
        probe = self.path(f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                # Full is not misconfigured: a restart must still resume, and the start-up clearing of a
                # crashed save's leftovers may be what frees the space. Saves name the full disk if it stays.
                with contextlib.suppress(OSError):
                    self.fs.rm_file(probe)
                log.warning(
                    "The %s checkpoint tier %s is full: resuming works, saving fails until space is freed",
                    self.name,
                    self.url,
                )
                return
            raise ConfigError(self._access_message("not writable", exc)) from exc

    def check_readable(self) -> None:
        try:
            self.fs.ls(self.root, detail=False) if self.fs.exists(self.root) else None
        except Exception as exc:
            raise ConfigError(self._access_message("not readable", exc)) from exc

    def _access_message(self, what: str, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        if self.is_local:
            fix = "point it at a directory this user can write, or fix its permissions"
        elif "credential" in text.lower() or "NoCredentials" in text or "AccessDenied" in text:
            fix = (
                "provide credentials (environment variables such as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "a profile, or storage_options key/secret) with access to this location"
            )
        else:
            fix = "check the URL, the bucket or container, the endpoint and the credentials in storage_options"
        return f"The {self.name} checkpoint tier {self.url} is {what} ({text}): {fix}"

    # ---- listing -----------------------------------------------------------------------------------------

    def list_steps(self) -> dict[int, str]:
        """Step number to directory path, for every ``step-<N>`` directory under the root."""
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        steps: dict[int, str] = {}
        for entry in entries:
            if entry.get("type") != "directory":
                continue
            match = STEP_DIR.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if match:
                steps[int(match.group(1))] = entry["name"].rstrip("/")
        return steps

    def file_sizes(self, directory: str) -> dict[str, int]:
        """Relative path to size of every file below ``directory`` (one listing call on object stores)."""
        try:
            found = self.fs.find(directory, detail=True)
        except FileNotFoundError:
            return {}
        prefix = directory.rstrip("/") + "/"
        return {
            name[len(prefix) :]: int(info.get("size") or 0)
            for name, info in found.items()
            if name.startswith(prefix) and info.get("type", "file") == "file"
        }

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    # ---- data ----------------------------------------------------------------------------------------------

    def open(self, path: str, mode: str = "rb") -> IO[bytes]:
        return self.fs.open(path, mode)

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def write_exclusive(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        """Make ``path`` appear whole, and only if it does not exist yet (``FileExistsError`` otherwise)."""
        if self.is_local:
            _write_local_exclusive(path, data, fsync=fsync)
        else:
            self.fs.pipe_file(path, data, mode="create")

    def put_file(self, local_path: str, path: str, callback: Callback | None = None) -> None:
        """Copy a local file here; ``callback`` (fsspec's) hears of the bytes as they go, where the backend tells."""
        if self.is_local:  # object stores have no directories; a local destination needs its parent
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.put_file(local_path, path, callback=callback or DEFAULT_CALLBACK)

    def remove_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)


def _write_local_exclusive(path: str, data: bytes, *, fsync: bool) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        # link() fails if the target exists, unlike rename(): a committed manifest is never replaced.
        os.link(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if fsync:
        fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
