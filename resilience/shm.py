"""Named shared-memory segments for staging buffers, and reclaiming those of killed jobs.

A staging segment holds this rank's whole share of the state (tens of GB on a GPU node), and ``/dev/shm`` is
memory: a segment whose name is never unlinked stays allocated until the machine reboots. Python's resource
tracker unlinks a killed process's segments, but only if the tracker itself survives, and a job killed as a
process group (an agent's SIGKILL, SLURM's, the OOM killer's cgroup kill) takes the tracker with it. The relaunch,
often on the same machine, would then find its memory gone. So each segment is named ``trs_<pid>_<random>`` and
its creator holds a shared ``flock`` on it for as long as it lives; any process that starts staging removes the
segments of that name that no process holds any more. A lock, not the pid, says who is alive: pids repeat, and
differ between containers that share one ``/dev/shm``.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import secrets
import time
from multiprocessing.shared_memory import SharedMemory

log = logging.getLogger(__name__)

PREFIX = "trs_"
SHM_DIR = "/dev/shm"
# A segment is created, then locked: one younger than this may be in between, and is left alone.
MIN_AGE_S = 60.0


def create_segment(nbytes: int) -> SharedMemory:
    """A new segment of ``nbytes``, locked by this process until it exits or closes it."""
    _reclaim_once()
    segment = SharedMemory(name=f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}", create=True, size=nbytes)
    fd = getattr(segment, "_fd", -1)
    if fd >= 0:  # Linux and macOS keep the descriptor open while the segment is mapped
        fcntl.flock(fd, fcntl.LOCK_SH)
    return segment


@functools.cache
def _reclaim_once() -> int:
    """:func:`reclaim_orphans`, at the first staging of this process only."""
    return reclaim_orphans()


def reclaim_orphans(directory: str = SHM_DIR, min_age_s: float = MIN_AGE_S) -> int:
    """Unlink the staging segments in ``directory`` that no live process holds; returns the bytes freed."""
    try:
        names = [name for name in os.listdir(directory) if name.startswith(PREFIX)]
    except OSError:  # no /dev/shm (not Linux): nothing to reclaim this way
        return 0
    freed = 0
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if now - info.st_ctime < min_age_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its creator lives
            os.unlink(path)
            freed += info.st_size
        except OSError:
            continue
        finally:
            os.close(fd)
    if freed:
        log.warning(
            "reclaimed %.1f MiB of checkpoint staging memory in %s left by killed processes", freed / 2**20, directory
        )
    return freed
