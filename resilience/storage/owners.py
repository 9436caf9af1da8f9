"""Who writes to a checkpoint root: owner records, so that two processes never destroy each other's saves.

A job that saves to a root leaves a record in ``<root>/.owners/``, and its local leader names itself in every
step directory it is writing (``.writer.json``) until the commit. Start-up cleanup removes a crashed save's
leftovers only when their writer is gone, and a second live job is refused instead of racing the first.

Liveness: a writer in this process is alive while its manager is open (a closed or crashed save of an
earlier manager here is a leftover like any other); one elsewhere on this machine while its process is (the pid
*and* its start time, so a reused pid does not count); one on another machine (a shared file system) while
its record's beat counter moves (:mod:`resilience.recovery.beats`): its process cannot be looked at from here, and its
record's modification time comes from another clock. "This machine" is the same boot and the same pid
namespace, not merely the same host name: containers on two hosts may share one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Collection
from dataclasses import asdict, dataclass, field

from resilience.errors import ConfigError
from resilience.recovery import beats
from resilience.storage.layout import OWNERS_DIR
from resilience.storage.processes import process_start_ticks
from resilience.storage.tiers import replace_local

log = logging.getLogger(__name__)
_OPEN_TOKENS: set[str] = set()  # owners of this process whose manager is still open


@functools.cache
def machine_id() -> str:
    """This boot of this machine and this pid namespace: where a pid names the same process as here."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{boot}/{namespace}"


@dataclass(frozen=True)
class Owner:
    """One process that writes checkpoints: enough to tell later whether it is still there."""

    host: str
    pid: int
    start_ticks: int | None
    run_id: str | None = None
    since: float = 0.0
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    machine: str = ""  # machine_id() of the owner; records of older releases lack it

    @classmethod
    def me(cls, run_id: str | None = None) -> Owner:
        """A new owner for this process; it counts as alive here until :meth:`release`."""
        pid = os.getpid()
        owner = cls(socket.gethostname(), pid, process_start_ticks(pid), run_id, time.time(), machine=machine_id())
        _OPEN_TOKENS.add(owner.token)
        return owner

    def release(self) -> None:
        _OPEN_TOKENS.discard(self.token)

    @property
    def id(self) -> str:
        return f"{self.host}.{self.pid}"

    def on_this_machine(self) -> bool:
        """Whether its pid can be looked up here (an older record without a machine: by host name)."""
        return self.machine == machine_id() if self.machine else self.host == socket.gethostname()

    def is_me(self) -> bool:
        return self.on_this_machine() and self.pid == os.getpid()

    def alive_here(self) -> bool | None:
        """Alive or not, as told on this machine; None for an owner elsewhere (watch its beat instead)."""
        if not self.on_this_machine():
            return None
        if self.is_me():
            return self.token in _OPEN_TOKENS
        ticks = process_start_ticks(self.pid)
        return ticks is not None and (self.start_ticks is None or ticks == self.start_ticks)

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host}, run {self.run_id}, since {since}"

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
                machine=str(body.get("machine", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None


def read_owner(path: str) -> tuple[Owner | None, int | None]:
    """The record at ``path`` and its beat; (None, None) when there is none."""
    try:
        with open(path) as handle:
            body = json.load(handle)
    except (OSError, ValueError):
        return None, None
    beat = body.get("beat") if isinstance(body, dict) else None
    return Owner.from_json(body), beat if isinstance(beat, int) else None


def writer_alive(path: str, live: Collection[str] = ()) -> bool:
    """Whether the writer named in a step directory's ``.writer.json`` is still at work: judged here when it is
    on this machine, else by whether its owner's token is among ``live`` (owners whose beat was seen to move)."""
    owner, _ = read_owner(path)
    if owner is None:
        return False
    here = owner.alive_here()
    return owner.token in live if here is None else here


class Owners:
    """The owner records of one local root; each one's beat is raised by its owner's heartbeat."""

    def __init__(self, root: str):
        self.directory = os.path.join(root, OWNERS_DIR)
        self._beats: dict[str, int] = {}

    def _records(self) -> dict[str, tuple[Owner, int | None]]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        found = {}
        for name in sorted(names):
            owner, beat = read_owner(os.path.join(self.directory, name))
            if owner is not None:
                found[name] = (owner, beat)
        return found

    def live_others(self) -> list[Owner]:
        """Live owners in other processes; records of dead ones (and closed ones of this process) are removed.

        Owners on other machines are watched together, for up to :data:`resilience.recovery.beats.WATCH_S` seconds when
        one of them is gone (none when every record is of this machine).
        """
        found: list[Owner] = []
        dead: list[str] = []
        elsewhere: dict[str, Owner] = {}
        for name, (owner, _) in self._records().items():
            here = owner.alive_here()
            if here is None:
                elsewhere[name] = owner
            elif not here:
                dead.append(name)
            elif not owner.is_me():
                found.append(owner)
        if elsewhere:
            log.info("watching %d owner record(s) of other machines in %s for a beat", len(elsewhere), self.directory)

            def read() -> dict[str, object]:
                return {name: beat for name, (_, beat) in self._records().items() if name in elsewhere}

            moving = beats.still_beating(read)
            found += [owner for name, owner in elsewhere.items() if name in moving]
            dead += [name for name in elsewhere if name not in moving]
        for name in dead:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, name))
        return found

    def claim(self, owner: Owner) -> None:
        """Register ``owner``, or raise :class:`ConfigError` naming the live job that owns the root."""
        others = self.live_others()
        if others:
            root = os.path.dirname(self.directory)
            raise ConfigError(
                f"local_root {root} is in use by another live job ({others[0].describe()}): two jobs writing one "
                "root would destroy each other's saves. Give this job its own local_root (and durable_url), or "
                "stop the other one"
            )
        self.register(owner)

    def _path(self, owner: Owner) -> str:
        return os.path.join(self.directory, f"{owner.id}.{owner.token}.json")

    def register(self, owner: Owner) -> None:
        """Leave this owner's record; on a full disk only warn (a resume must still work, saves will say why)."""
        self._beats[owner.token] = 0
        try:
            self._write(owner)
        except OSError as exc:
            log.warning("could not record this job as the owner of %s (%s)", self.directory, exc)

    def registered(self, owner: Owner) -> bool:
        """Whether this owner's record is still there (another machine removes it when it finds it gone)."""
        return os.path.exists(self._path(owner))

    def beat(self, owner: Owner) -> None:
        """Raise this owner's beat (its heartbeat calls it): a watcher on another machine sees it move. A record
        that is gone is not made again: a job elsewhere found it gone and may hold the root now."""
        if not self.registered(owner):
            raise FileNotFoundError(f"this job's owner record in {self.directory} was removed by another job")
        self._beats[owner.token] = self._beats.get(owner.token, 0) + 1
        self._write(owner)

    def _write(self, owner: Owner) -> None:
        body = {**owner.to_json(), "beat": self._beats.get(owner.token, 0)}
        replace_local(self._path(owner), json.dumps(body).encode())

    def unregister(self, owner: Owner) -> None:
        owner.release()
        self._beats.pop(owner.token, None)
        with contextlib.suppress(OSError):
            os.unlink(self._path(owner))
