"""Processes on this machine, told apart by pid *and* start time, so that a reused pid does not count.

Standard library only: the peer server (:mod:`resilience.storage.peer_server`) runs as a script that imports
nothing of the pack, whose package imports torch.
"""

from __future__ import annotations


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None if there is no such live process
    (a zombie, killed but not yet reaped by its parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    try:
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (IndexError, ValueError):
        return None
