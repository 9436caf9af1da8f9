"""Storage tiers: a small interface with derived methods, and its two kinds.

* :class:`LocalTier` is a POSIX directory (node-local NVMe or a shared file system). DCP writes shards into it
  with plain file I/O, so it refuses URLs: ``local_root="memory://x"`` would otherwise pass every check and then
  have its shards written to the host's ``/x/``.
* :class:`DurableTier` is any fsspec URL (``s3://``, ``gs://``, ``file://``, ``memory://``, or a path). Committed
  checkpoints are uploaded there; a fresh node resumes from it.

The one operation that matters for correctness is :meth:`Tier.write_exclusive`, which makes a manifest appear
whole and at most once (a rename-free ``link()`` on POSIX, a conditional single PUT on object stores).

DCP reads and writes checkpoints through tiers too: :mod:`resilience.storage.dcp_fs` gives it a tier as its
file-system interface (kept apart because importing DCP takes seconds that ``resilience ls`` need not pay).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping
from typing import IO, Any

import fsspec
from fsspec.callbacks import DEFAULT_CALLBACK, Callback
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from resilience.errors import ConfigError
from resilience.persist.direct_io import HashedFileStream, Written, open_for_read
from resilience.storage.layout import PROBE_PREFIX, parse_step_dirname, step_dirname

log = logging.getLogger(__name__)
_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")
_KNOWN_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs", "memory", "file", "http", "https")
# "s3//bucket", "s3:/bucket", "s3:bucket": a scheme whose separator lost a character.
_MISTYPED_URL = re.compile(rf"^({'|'.join(_KNOWN_SCHEMES)})(//|:/(?!/)|:(?!/))", re.IGNORECASE)


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


def check_not_mistyped(setting: str, text: str) -> None:
    """Refuse ``s3//bucket/run`` and kin, which fsspec would silently take for a local folder."""
    match = _MISTYPED_URL.match(text)
    if match:
        scheme = match.group(1).lower()
        rest = text[match.end() :].lstrip("/")
        raise ConfigError(
            f"{setting}={text!r} looks like a mistyped URL (it would become a local folder): did you mean "
            f"'{scheme}://{rest}'?"
        )


class Tier:
    """A place checkpoints live: a root holding ``step-<N>/`` directories, reached through an fsspec filesystem.

    Subclasses set ``fs``, ``root`` and ``url`` and may override the primitives; everything else is derived.
    """

    name: str
    fs: fsspec.AbstractFileSystem
    root: str
    url: str
    is_local: bool

    # ---- paths (derived) ---------------------------------------------------------------------------------

    @property
    def process_local(self) -> bool:
        """``memory://``: each process sees its own, so no other job can share it, and a helper process does not
        see what its training process wrote there (the lease among it)."""
        return type(self.fs).__name__ == "MemoryFileSystem"

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) if self.root != "/" else "/" + "/".join(parts)

    def step_path(self, step: int, *parts: str) -> str:
        return self.path(step_dirname(step), *parts)

    def display(self, path: str) -> str:
        return path

    # ---- listing -----------------------------------------------------------------------------------------

    def list_steps(self) -> dict[int, str]:
        """Step number to directory path, for every ``step-<N>`` directory under the root."""
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        steps: dict[int, str] = {}
        for entry in entries:
            step = parse_step_dirname(entry["name"]) if entry.get("type") == "directory" else None
            if step is not None:
                steps[step] = entry["name"].rstrip("/")
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
        raise NotImplementedError

    def write_replace(self, path: str, data: bytes) -> None:
        """Make ``path`` hold ``data``, replacing what it held; a reader sees the old bytes or the new, never a
        part (one PUT on object stores). For small records a single writer rewrites (beats, writer markers)."""
        self.fs.pipe_file(path, data)

    def makedirs(self, path: str) -> None:
        """Make the directory ``path`` and its parents, if missing. Callers skip object stores: they have no
        directories, and there this could make a bucket, which the engine never does."""
        self.fs.makedirs(path, exist_ok=True)

    def rename(self, path: str, new_path: str) -> None:
        """Move a file to ``new_path`` (on object stores a copy and a delete, so a prefix is never moved whole)."""
        self.fs.mv(path, new_path)

    def forget(self, path: str) -> None:
        """Drop what the filesystem object remembers of listings under ``path`` (s3fs caches them), so that the
        next listing sees what other processes wrote since."""
        self.fs.invalidate_cache(path)

    def put_file(self, local_path: str, path: str, callback: Callback | None = None) -> None:
        """Copy a local file here; ``callback`` (fsspec's) hears of the bytes as they go, where the backend tells."""
        self.fs.put_file(local_path, path, callback=callback or DEFAULT_CALLBACK)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def remove_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    # ---- checks --------------------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Prove a file can be written under the root, so a bad root fails at set-up, not at step N."""
        probe = self.path(f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            self._prepare_root()
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except ConfigError:
            raise
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
            if self.fs.exists(self.root):
                self.fs.ls(self.root, detail=False)
        except Exception as exc:
            raise ConfigError(self._access_message("not readable", exc)) from exc

    def _prepare_root(self) -> None:
        """Make the root exist before the probe (a directory locally; nothing on object stores)."""
        self.makedirs(self.root)

    def _access_message(self, what: str, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        if self.is_local:
            fix = "point it at a directory this user can write, or fix its permissions"
        elif "credential" in text.lower() or "NoCredentials" in text or "AccessDenied" in text:
            fix = (
                "provide credentials (environment variables such as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "a profile, or storage_options key/secret) with access to this location"
            )
        elif "Connect" in text or "Endpoint" in text or "timed out" in text.lower():
            fix = "check the endpoint (storage_options endpoint_url, or AWS_ENDPOINT_URL) and that it is reachable"
        else:
            fix = "check the URL, the bucket or container, the endpoint and the credentials in storage_options"
        return f"The {self.name} checkpoint tier {self.url} is {what} ({text[:500]}): {fix}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class LocalTier(Tier):
    """The fast tier: a POSIX directory, written by DCP with plain file I/O.

    Args:
        root: A directory path (relative paths are made absolute). URLs are refused.
        setting: The name of the setting the path came from, for error messages.
    """

    is_local = True

    def __init__(self, root: str | os.PathLike[str], *, setting: str = "local_root") -> None:
        text = os.fspath(root)
        if not text:
            raise ConfigError(f"{setting} is empty: give a directory for the fast checkpoint tier")
        check_not_mistyped(setting, text)
        if "://" in text:
            raise ConfigError(
                f"{setting}={text!r} is a URL, but the fast tier must be a directory on this machine (DCP writes "
                "it with file I/O): give a local or shared-file-system path here, and the URL as durable_url"
            )
        self.name = "local"
        self.fs = LocalFileSystem()
        self.root = os.path.abspath(os.path.expanduser(text))
        self.url = self.root

    def open(self, path: str, mode: str = "rb") -> IO[bytes]:
        """Files are read past the page cache unless cached already
        (:func:`resilience.persist.direct_io.open_for_read`):
        a shard is written with ``O_DIRECT``, so a resume or a name made from it would otherwise fill the cache
        with it, at a page's cost per 4 KiB."""
        if mode == "rb":
            return open_for_read(path)
        return super().open(path, mode)

    def open_hashed(self, path: str, done: Callable[[Written], None], *, direct: bool, fsync: bool) -> HashedFileStream:
        """A new file hashed as it is written (:class:`~resilience.persist.direct_io.HashedFileStream`): past the
        page cache with ``direct``, synced as it closes with ``fsync``; ``done`` hears its :class:`Written` once it
        is whole, so a commit's checksums cost no second read of what was just written."""
        return HashedFileStream(path, direct=direct, fsync=fsync, done=done)

    def write_exclusive(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        write_local_exclusive(path, data, fsync=fsync)

    def write_replace(self, path: str, data: bytes) -> None:
        replace_local(path, data)

    def put_file(self, local_path: str, path: str, callback: Callback | None = None) -> None:
        self.makedirs(os.path.dirname(path))
        super().put_file(local_path, path, callback)

    def rename(self, path: str, new_path: str) -> None:
        """One ``rename(2)``: a directory moves whole and at once."""
        self.makedirs(os.path.dirname(new_path))
        os.rename(path, new_path)


class DurableTier(Tier):
    """The durable tier at an fsspec URL.

    Args:
        url: ``s3://bucket/prefix``, ``gs://...``, ``file:///...``, ``memory://...`` or a path.
        storage_options: Passed to the fsspec filesystem; never shown unredacted.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        setting: str = "durable_url",
    ) -> None:
        text = os.fspath(url)
        if not text:
            raise ConfigError(f"{setting} is empty: give an fsspec URL such as s3://bucket/run, or leave it unset")
        check_not_mistyped(setting, text)
        options = dict(storage_options or {})
        try:
            fs, root = url_to_fs(text, **options)
        except ValueError as exc:
            known = ", ".join(sorted(p + "://" for p in ("s3", "gs", "file", "memory", "az", "hdfs")))
            raise ConfigError(
                f"Unknown storage URL scheme in {setting}={text!r} ({exc}): use a path or one of {known}, "
                "or install the fsspec backend that provides this scheme"
            ) from exc
        except ImportError as exc:
            raise ConfigError(
                f"The backend for {setting}={text!r} is not installed ({exc}): install it, e.g. "
                "`pip install s3fs` for s3:// or `pip install gcsfs` for gs://"
            ) from exc
        self.name = "durable"
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(fs, LocalFileSystem)
        self._options_shown = redact(options)
        self.url = self.root if self.is_local else self._unstrip(self.root)

    def __repr__(self) -> str:
        return f"DurableTier({self.url!r}, storage_options={self._options_shown})"

    def _unstrip(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{path}"

    def display(self, path: str) -> str:
        return path if self.is_local else self._unstrip(path)

    @property
    def is_object_store(self) -> bool:
        """Buckets and containers: no real directories, and a bucket is never made by a check."""
        return not self.is_local and type(self.fs).__name__ != "MemoryFileSystem"

    def write_exclusive(self, path: str, data: bytes, *, fsync: bool = True) -> None:
        if self.is_local:
            write_local_exclusive(path, data, fsync=fsync)
        else:
            self.fs.pipe_file(path, data, mode="create")

    def write_replace(self, path: str, data: bytes) -> None:
        if self.is_local:
            replace_local(path, data)
        else:
            super().write_replace(path, data)

    def put_file(self, local_path: str, path: str, callback: Callback | None = None) -> None:
        if self.is_local:  # object stores have no directories; a local destination needs its parent
            self.makedirs(path.rsplit("/", 1)[0])
        super().put_file(local_path, path, callback)

    def _prepare_root(self) -> None:
        if not self.is_object_store:
            super()._prepare_root()
            return
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.info(bucket)  # unlike exists(), it says why (no credentials, no endpoint) instead of False
        except FileNotFoundError:
            raise ConfigError(
                f"The durable checkpoint tier {self.url}: bucket {bucket!r} does not exist (or these credentials "
                "cannot see it). Create the bucket, or fix the name in durable_url; a check never creates one"
            ) from None
        except Exception as exc:
            raise ConfigError(self._access_message("not reachable", exc)) from exc


def write_local_exclusive(path: str, data: bytes, *, fsync: bool) -> None:
    # link() fails if the target exists, unlike rename(): a committed manifest is never replaced.
    _place_local(path, data, fsync=fsync, place=os.link)


def replace_local(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path`` (atomic on POSIX)."""
    _place_local(path, data, fsync=False, place=os.replace)


def _place_local(path: str, data: bytes, *, fsync: bool, place: Callable[[str, str], None]) -> None:
    """Write a temporary file beside ``path`` and ``place`` it there, so ``path`` never holds a part of ``data``."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        place(tmp, path)
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
