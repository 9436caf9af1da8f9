"""One job writes to a durable URL at a time: a lease with generations, and fencing of a job that lost it.

The lease lives under the URL::

    .lease/<generation>.json    who holds it: an owner record (host, pid, machine, run id, token); created
                                exclusively (O_EXCL-like link() on a file system, a conditional PUT on an object
                                store) and never rewritten, so two claimants of one generation cannot both win
    .lease/<generation>.beat    {"beat": n, "released": false}: raised every few seconds by the holder only

The holder is the newest generation. A job claims the lease at start-up by creating the next generation, once
it has judged the holder: a released lease, or one held by an earlier process of the same run (a relaunch that
resumed it), is taken at once; a holder on this machine is alive while its process is; a holder elsewhere is
alive while its beat moves (:mod:`resilience.recovery.beats`: no clock is compared). A live holder of another run is
refused with a clear error.

Start-up checks alone cannot keep two jobs apart (a job may be judged gone while it is only stalled, and a
relaunch takes over a run's lease at once), so the holder is checked again before every change to the durable
tier: before a step's files are uploaded, before its manifest is written, before each deletion. A job whose
lease was taken over fails that upload with a clear error and deletes nothing; its local commits stay.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re

from resilience.errors import CheckpointError, ConfigError
from resilience.recovery import beats
from resilience.recovery.beats import Heartbeat
from resilience.storage.layout import LEASE_DIR
from resilience.storage.owners import Owner, Owners
from resilience.storage.tiers import Tier

log = logging.getLogger(__name__)

KEEP_GENERATIONS = 4  # older generations are removed by the claimant of a new one
ATTEMPTS = 8  # claims lost to other claimants before giving up
_GENERATION = re.compile(r"^(\d{8,})\.json$")


def generations(tier: Tier) -> list[int]:
    """The lease generations under ``tier``'s root, oldest first (listed afresh: other jobs write them)."""
    directory = tier.path(LEASE_DIR)
    tier.forget(directory)
    try:
        names = tier.fs.ls(directory, detail=False)
    except FileNotFoundError:
        return []
    found = (_GENERATION.match(str(name).rstrip("/").rsplit("/", 1)[-1]) for name in names)
    return sorted(int(match.group(1)) for match in found if match)


def _record(tier: Tier, generation: int, suffix: str) -> str:
    return tier.path(LEASE_DIR, f"{generation:08d}.{suffix}")


def holder_of(tier: Tier, generation: int) -> Owner | None:
    """Who created ``generation``; None when its record cannot be read as one."""
    try:
        return Owner.from_json(json.loads(tier.read_bytes(_record(tier, generation, "json"))))
    except (FileNotFoundError, ValueError):
        return None


def read_beat(tier: Tier, generation: int) -> tuple[int | None, bool]:
    """The holder's beat and whether it released the lease; (None, False) when there is no beat record."""
    try:
        body = json.loads(tier.read_bytes(_record(tier, generation, "beat")))
    except (FileNotFoundError, ValueError):
        return None, False
    if not isinstance(body, dict):
        return None, False
    beat = body.get("beat")
    return (beat if isinstance(beat, int) else None), body.get("released") is True


class Lease:
    """This job's hold on a durable URL (rank 0's): :meth:`acquire` once, :meth:`beat` from a heartbeat."""

    def __init__(self, tier: Tier, owner: Owner):
        self.tier = tier
        self.owner = owner
        self.generation: int | None = None
        self.lost = False
        self._beat = 0

    def acquire(self) -> None:
        """Become the holder, or raise :class:`ConfigError` naming the live job that holds the URL."""
        for _ in range(ATTEMPTS):
            found = generations(self.tier)
            newest = found[-1] if found else 0
            if newest:
                holder = holder_of(self.tier, newest)
                if holder is not None and holder.token == self.owner.token:
                    self.generation = newest
                    return
                verdict = self._may_take(newest, holder)
                if verdict is None:
                    continue  # the lease changed hands while it was watched: judge the new holder
                if not verdict:
                    assert holder is not None
                    raise ConfigError(
                        f"durable_url {self.tier.url} is in use by another live job ({holder.describe()}): two jobs "
                        "writing one durable_url would destroy each other's checkpoints. Give this job its own "
                        "durable_url, or stop the other one"
                    )
            if self._create(newest + 1):
                self.generation = newest + 1
                self._prune(found)
                return
        raise ConfigError(f"durable_url {self.tier.url}: other jobs kept taking its lease; start one job at a time")

    def _may_take(self, generation: int, holder: Owner | None) -> bool | None:
        """Whether ``holder``'s lease may be taken now; None when it changed hands while being watched."""
        _, released = read_beat(self.tier, generation)
        if holder is None or released:
            return True
        if holder.run_id is not None and holder.run_id == self.owner.run_id:
            # a relaunch of the same run: the normal way back after any stop, not a warning
            earlier = "this process's previous generation" if holder.is_me() else "an earlier process of this run"
            log.info("durable_url %s: taking over from %s (%s)", self.tier.url, earlier, holder.describe())
            return True
        alive = holder.alive_here()
        if alive is None:
            log.warning(
                "durable_url %s is held by a job on another machine (%s): watching its beat for up to %.0f s",
                self.tier.url,
                holder.describe(),
                beats.WATCH_S,
            )

            def read() -> dict[str, object]:
                found = generations(self.tier)
                return {"lease": (found[-1] if found else None, read_beat(self.tier, generation))}

            if beats.still_beating(read):
                found = generations(self.tier)
                if not found or found[-1] != generation or read_beat(self.tier, generation)[1]:
                    return None
                return False
            alive = False
        if not alive:
            log.warning("durable_url %s: taking over from a job that is gone (%s)", self.tier.url, holder.describe())
        return not alive

    def _create(self, generation: int) -> bool:
        """Create ``generation`` for this job; False when another claimant got it first."""
        path = _record(self.tier, generation, "json")
        try:
            self.tier.write_exclusive(path, json.dumps(self.owner.to_json()).encode())
        except FileExistsError:
            return False
        except Exception:
            holder = holder_of(self.tier, generation)  # a lost response of a write that landed
            if holder is None or holder.token != self.owner.token:
                raise
        self._beat = 0
        self._write_beat(generation, released=False)
        # Read back: a store whose conditional create is not atomic could let two claimants both "succeed".
        holder = holder_of(self.tier, generation)
        return holder is not None and holder.token == self.owner.token

    def _write_beat(self, generation: int, *, released: bool) -> None:
        body = json.dumps({"beat": self._beat, "released": released}).encode()
        self.tier.write_replace(_record(self.tier, generation, "beat"), body)

    def _prune(self, found: list[int]) -> None:
        for old in found[:-KEEP_GENERATIONS] if len(found) >= KEEP_GENERATIONS else []:
            for suffix in ("json", "beat"):
                with contextlib.suppress(Exception):
                    self.tier.remove_file(_record(self.tier, old, suffix))

    def held(self) -> bool:
        """Whether this job is still the newest generation."""
        found = generations(self.tier)
        return self.generation is not None and bool(found) and found[-1] == self.generation

    def beat(self) -> None:
        """Show watchers that the holder lives; once another generation is newer, stop (this job is fenced)."""
        if self.generation is None or self.lost:
            return
        if not self.held():
            self.lost = True
            log.warning(
                "durable_url %s was taken over by another job: this job's next upload there will fail", self.tier.url
            )
            return
        self._beat += 1
        self._write_beat(self.generation, released=False)

    def release(self) -> None:
        """Let the next job take the lease at once (a closed job writes no more)."""
        if self.generation is not None and not self.lost and self.held():
            self._write_beat(self.generation, released=True)

    def renew(self) -> None:
        """Hold the lease again after :meth:`release` (a rest): still the newest generation, take it back;
        else judge whoever took it, as :meth:`acquire` does."""
        if self.generation is not None and not self.lost and self.held():
            self._write_beat(self.generation, released=False)
            return
        self.lost = False
        self.acquire()


class Fence:
    """The uploader's check that its job still holds the lease, before every change to the durable tier.

    Works from storage alone (the uploader may run in a helper process): the job is named by its owner token.
    Generation records are never rewritten, so each is read once.
    """

    def __init__(self, tier: Tier):
        self.tier = tier
        self._holders: dict[int, Owner] = {}

    def newest(self) -> tuple[int, Owner | None] | None:
        """The newest generation and its holder (reads storage: retry it like any transfer)."""
        found = generations(self.tier)
        if not found:
            return None
        generation = found[-1]
        if generation not in self._holders:
            holder = holder_of(self.tier, generation)
            if holder is None:
                return generation, None
            self._holders[generation] = holder
        return generation, self._holders[generation]

    def judge(self, newest: tuple[int, Owner | None] | None, token: str, what: str) -> None:
        """Raise :class:`CheckpointError` unless ``newest`` is the job with ``token``; ``what`` is what is refused."""
        holder = newest[1] if newest is not None else None
        if holder is not None and holder.token == token:
            return
        who = f"another job ({holder.describe()})" if holder is not None else "another job, or its lease was removed"
        raise CheckpointError(
            f"durable_url {self.tier.url} was taken over by {who}: this job no longer writes there, so {what} was "
            "refused (its local commit stays). Two jobs must not share a durable_url: stop one, or give each its own"
        )


class Tenancy:
    """What a manager holds while it writes (its owner record, the durable lease) and the heartbeat behind them.

    Every rank has one; only the local leaders beat an owner record, and only rank 0 the lease.
    """

    def __init__(self, owners: Owners | None, owner: Owner, lease: Lease | None):
        self.owners = owners
        self.owner = owner
        self.lease = lease
        jobs = ([lambda: owners.beat(owner)] if owners is not None else []) + ([lease.beat] if lease else [])
        self.heart = Heartbeat(jobs)

    def pause(self, *, release: bool) -> None:
        """Stop beating (an engine at rest has no thread); with ``release``, let another job take the URL at
        once: a resting engine is not training (Lightning's after ``fit()``), and may never save again."""
        self.heart.stop()
        if release and self.lease is not None:
            with contextlib.suppress(Exception):
                self.lease.release()

    def resume(self) -> None:
        """Hold the root and the URL again after a rest, and beat: what another job took meanwhile is judged as
        at start-up (a live job that holds it now stops this one with :class:`ConfigError`)."""
        if self.lease is not None:
            self.lease.renew()
        if self.owners is not None and not self.owners.registered(self.owner):
            self.owners.claim(self.owner)
        self.heart.start()

    def end(self) -> None:
        """Stop beating and release the lease (the next job takes it at once)."""
        self.heart.stop()
        if self.lease is not None:
            with contextlib.suppress(Exception):
                self.lease.release()
