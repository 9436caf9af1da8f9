"""Named shared-memory segments for staging buffers, and reclaiming those of killed jobs.

A staging segment holds this rank's whole share of the state (tens of GB on a GPU node), and ``/dev/shm`` is
memory: a segment whose name is never unlinked stays allocated until the machine reboots. Python's resource
tracker unlinks a killed process's segments, but only if the tracker itself survives, and a job killed as a
process group (an agent's SIGKILL, SLURM's, the OOM killer's cgroup kill) takes the tracker with it. The relaunch,
often on the same machine, would then find its memory gone. So each process that stages names its segments
``trs_<token>_<n>`` and holds a shared ``flock`` on one more, ``trs_<token>_lock``, for as long as it lives; any
process that starts staging removes the segments whose lock no process holds any more. A lock, not the pid, says
who is alive: pids repeat, and differ between containers that share one ``/dev/shm``.

One lock per process, not one per segment: a lock needs an open descriptor, and a sharded state of thousands of
tensors (FSDP shards and Adam's moments of every parameter) would hold thousands, past the usual limit of 1,024.
A segment's own descriptor is closed once it is mapped (:func:`map_segment`); the mapping stays.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import itertools
import logging
import os
import secrets
import sys
import time
from multiprocessing import resource_tracker
from typing import cast

import torch

log = logging.getLogger(__name__)

PREFIX = "trs_"
LOCK_SUFFIX = "_lock"
SHM_DIR = "/dev/shm"
# A lock is created, then taken: one younger than this may be in between, and is left alone.
MIN_AGE_S = 60.0
_counter = itertools.count()


def create_segment(nbytes: int) -> tuple[str, torch.Tensor]:
    """A new segment of ``nbytes`` and its mapping here (flat ``uint8``); reclaimable only once this process is gone,
    or by :func:`release_segment`."""
    _reclaim_once()
    name = f"{PREFIX}{_token()}_{next(_counter)}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    _start_quiet_tracker()
    resource_tracker.register(f"/{name}", "shared_memory")  # the tracker unlinks it if this process is killed
    return name, map_segment(name, nbytes)


def map_segment(name: str, nbytes: int | None = None) -> torch.Tensor:
    """Segment ``name`` mapped (shared, writable) as a flat ``uint8`` tensor.

    Through torch rather than ``SharedMemory``: Python's ``mmap`` keeps a duplicate descriptor per mapping (and
    ``SharedMemory`` one more), torch closes its descriptor once the file is mapped.
    """
    path = os.path.join(SHM_DIR, name)
    size = os.stat(path).st_size if nbytes is None else nbytes
    storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(path, shared=True, nbytes=size))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def release_segment(name: str) -> None:
    """Unlink a segment of this process (mappings stay valid until they are dropped)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))
    with contextlib.suppress(Exception):
        resource_tracker.unregister(f"/{name}", "shared_memory")


@functools.cache
def _start_quiet_tracker() -> None:
    """Start Python's resource tracker (once per process) with its leak warning off. When a training process is
    killed (an in-place restart replaces it after its peer died), the tracker unlinks the process's staging
    segments, which is what it is for, and then warns about "leaked shared_memory objects", listing every name:
    thousands of them, one per staged tensor, in a recovery that went as planned. The tracker takes its warning
    filters from ``sys.warnoptions`` when it starts; the filter is there for that moment only. A tracker already
    started by other code keeps its own settings."""
    quiet = "ignore:resource_tracker:UserWarning"
    sys.warnoptions.append(quiet)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(quiet)


@functools.cache
def _token() -> str:
    """This process's segment names' token; its lock is made and held from the first call on (a shared ``flock``
    on a descriptor that stays open as long as the process lives)."""
    token = f"{os.getpid()}_{secrets.token_hex(6)}"
    path = os.path.join(SHM_DIR, f"{PREFIX}{token}{LOCK_SUFFIX}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    atexit.register(_drop_lock, path, os.getpid())
    return token


def _drop_lock(path: str, creator: int) -> None:
    """At a clean exit of the process that made the lock; not in a forked child, whose exit would leave the
    parent's segments unguarded."""
    if os.getpid() == creator:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@functools.cache
def _reclaim_once() -> int:
    """:func:`reclaim_orphans`, at the first staging of this process only."""
    return reclaim_orphans()


def reclaim_orphans(directory: str = SHM_DIR, min_age_s: float = MIN_AGE_S) -> int:
    """Unlink the staging segments in ``directory`` that no live process holds; returns the bytes freed.

    A segment goes when its process's lock can be taken (that process is gone); a segment without a lock (one
    of an older release, which locked each segment itself) when the segment's own lock can.
    """
    try:
        names = sorted(name for name in os.listdir(directory) if name.startswith(PREFIX))
    except OSError:  # no /dev/shm (not Linux): nothing to reclaim this way
        return 0
    locks = {name[: -len(LOCK_SUFFIX)] for name in names if name.endswith(LOCK_SUFFIX)}
    dead = {prefix for prefix in locks if _free(os.path.join(directory, prefix + LOCK_SUFFIX), min_age_s)}
    freed = 0
    for name in names:
        path = os.path.join(directory, name)
        owner = name.rsplit("_", 1)[0]
        if name.endswith(LOCK_SUFFIX) or (owner in locks and owner not in dead):
            continue
        if owner in dead or _free(path, min_age_s):
            with contextlib.suppress(OSError):
                freed += os.stat(path).st_size
                os.unlink(path)
    for prefix in dead:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, prefix + LOCK_SUFFIX))
    if freed:
        log.warning(
            "reclaimed %.1f MiB of checkpoint staging memory in %s left by killed processes", freed / 2**20, directory
        )
    return freed


def _free(path: str, min_age_s: float) -> bool:
    """Whether no process holds ``path``'s lock (and it is older than ``min_age_s``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if time.time() - os.fstat(fd).st_ctime < min_age_s:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its holder lives
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
