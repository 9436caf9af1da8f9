"""Who writes to a checkpoint root: owner records, so that two processes never destroy each other's saves.

A job that saves to a root leaves a record in ``<root>/.owners/``, and its local leader names itself in every
step directory it is writing (``.writer.json``) until the commit. Start-up cleanup removes a crashed save's
leftovers only when their writer is gone, and a second live job is refused instead of racing the first.

Liveness: a writer in this process is alive while its manager is open (a closed or crashed save of an
earlier manager here is a leftover like any other); one elsewhere on this host while its process is (the pid
*and* its start time, so a reused pid does not count); one on another host (a shared file system) while its
record was touched within :data:`REMOTE_STALE_S`, since its process cannot be looked at from here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field

from resilience.layout import OWNERS_DIR

log = logging.getLogger(__name__)
REMOTE_STALE_S = 3600.0
_OPEN_TOKENS: set[str] = set()  # owners of this process whose manager is still open


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


@dataclass(frozen=True)
class Owner:
    """One process that writes checkpoints: enough to tell later whether it is still there."""

    host: str
    pid: int
    start_ticks: int | None
    run_id: str | None = None
    since: float = 0.0
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @classmethod
    def me(cls, run_id: str | None = None) -> Owner:
        """A new owner for this process; it counts as alive here until :meth:`release`."""
        pid = os.getpid()
        owner = cls(socket.gethostname(), pid, process_start_ticks(pid), run_id, time.time())
        _OPEN_TOKENS.add(owner.token)
        return owner

    def release(self) -> None:
        _OPEN_TOKENS.discard(self.token)

    @property
    def id(self) -> str:
        return f"{self.host}.{self.pid}"

    def is_me(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def alive(self, touched: float | None = None) -> bool:
        if self.is_me():
            return self.token in _OPEN_TOKENS
        if self.host != socket.gethostname():
            return touched is not None and time.time() - touched < REMOTE_STALE_S
        ticks = process_start_ticks(self.pid)
        return ticks is not None and (self.start_ticks is None or ticks == self.start_ticks)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: object) -> Owner | None:
        """Parse a record (None when it is not one: leftovers of other tools are not owners)."""
        if not isinstance(body, dict):
            return None
        try:
            ticks = body.get("start_ticks")
            run_id = body.get("run_id")
            return cls(
                host=str(body["host"]),
                pid=int(body["pid"]),
                start_ticks=int(ticks) if ticks is not None else None,
                run_id=str(run_id) if run_id is not None else None,
                since=float(body.get("since", 0.0)),
                token=str(body.get("token", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None


def read_owner(path: str) -> tuple[Owner | None, float | None]:
    """The record at ``path`` and when it was last touched; (None, None) when there is none."""
    try:
        with open(path) as handle:
            body = json.load(handle)
        touched = os.stat(path).st_mtime
    except (OSError, ValueError):
        return None, None
    return Owner.from_json(body), touched


def writer_alive(path: str) -> bool:
    """Whether the writer named in a step directory's ``.writer.json`` is still at work."""
    owner, touched = read_owner(path)
    return owner is not None and owner.alive(touched)


class Owners:
    """The owner records of one local root."""

    def __init__(self, root: str):
        self.directory = os.path.join(root, OWNERS_DIR)

    def live_others(self) -> list[Owner]:
        """Live owners in other processes; records of dead ones (and closed ones of this process) are removed."""
        found: list[Owner] = []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        for name in sorted(names):
            path = os.path.join(self.directory, name)
            owner, touched = read_owner(path)
            if owner is None:
                continue
            if owner.alive(touched):
                if not owner.is_me():
                    found.append(owner)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return found

    def _path(self, owner: Owner) -> str:
        return os.path.join(self.directory, f"{owner.id}.{owner.token}.json")

    def register(self, owner: Owner) -> None:
        """Leave this owner's record; on a full disk only warn (a resume must still work, saves will say why)."""
        path = self._path(owner)
        tmp = f"{path}.tmp"
        try:
            os.makedirs(self.directory, exist_ok=True)
            with open(tmp, "w") as handle:
                json.dump(owner.to_json(), handle)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("could not record this job as the owner of %s (%s)", self.directory, exc)

    def touch(self, owner: Owner) -> None:
        """Show a remote observer that this owner is still alive (called at every save)."""
        with contextlib.suppress(OSError):
            os.utime(self._path(owner))

    def unregister(self, owner: Owner) -> None:
        owner.release()
        with contextlib.suppress(OSError):
            os.unlink(self._path(owner))
