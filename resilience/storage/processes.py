"""Processes on this machine, told apart by pid *and* start time, so that a reused pid does not count.

Standard library only: the peer server (:mod:`resilience.storage.peer_server`) runs as a script that imports
nothing of the pack, whose package imports torch.
"""

from __future__ import annotations


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None if there is no such live process
    (a zombie, killed but not yet reaped by its parent, counts as gone)."""
    return _stat_field(pid, 19)


def process_parent(pid: int) -> int | None:
    """The pid of the process's parent, or None if there is no such live process (a zombie counts as gone)."""
    return _stat_field(pid, 1)


def _stat_field(pid: int, index: int) -> int | None:
    """Field ``index`` of ``/proc/<pid>/stat``, counted from the state (field 3, index 0), after the command's name
    (which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    try:
        return None if fields[0] in ("Z", "X") else int(fields[index])
    except (IndexError, ValueError):
        return None
