"""Healing the durable tier at start: this run's newest local checkpoints that it lacks, or holds damaged, go up again.

A committed step can be on this node's disk and not in the durable tier: its upload was cut short (a preemption's
grace ran out, the job was killed), or the durable copy was deleted since (a lifecycle rule, a person) or lost a
file. A resume reads the local copy, rightly; but nothing else would ever upload it again, and the next node to
start elsewhere would fall back to an older step. So when a run resumes, rank 0 (the holder of the durable lease)
checks its local steps against the durable tier in a background thread and uploads the missing ones again, with
one line that names them. It never delays training: it starts after the claim and reads nothing before returning.

Which steps: the newest ``keep_last`` committed local steps of this run (its run id, the one resumed) up to the
step resumed from, that hold every rank's files, and whose durable copy is missing, has no manifest, or fails a
size check (a file missing, or at another size than its manifest's). Older ones are left alone: retention would
delete them again, and a lifecycle rule that deletes old objects must not cost an upload at every start. Steps
newer than the one resumed from are an abandoned branch, and set aside at the first save. A durable step of
another run is not ours: it is never touched. Each upload goes through :func:`~resilience.persist.transfer.push_step`,
as ``resilience upload``'s do: verified first, fenced by the lease before it starts and before its commit, manifest
last; a damaged committed copy's manifest is first set aside as a resume would (``manifest.json.corrupt-<time>``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from resilience.config import CheckpointConfig
from resilience.errors import describe
from resilience.persist.transfer import RetryPolicy, Writer, guarded, push_step
from resilience.storage import catalog, client_retries
from resilience.storage.fencing import HEALING, DurableGuard
from resilience.storage.layout import CORRUPT_MANIFEST, MANIFEST
from resilience.storage.tiers import DurableTier, LocalTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealSettings:
    """How many steps to heal at most, and how their files are sent (the upload settings of the job)."""

    keep_last: int = 3
    concurrency: int = 8
    policy: RetryPolicy = field(default_factory=RetryPolicy)

    @classmethod
    def of(cls, config: CheckpointConfig) -> HealSettings:
        """The job's own settings."""
        policy = RetryPolicy(config.upload_retries, config.upload_backoff_s)
        return cls(config.keep_last, config.upload_concurrency, policy)


@dataclass(frozen=True)
class Stale:
    """A local step the durable tier should hold and does not: why, and the damaged durable copy to set aside."""

    local: catalog.Entry
    why: str
    damaged: catalog.Entry | None = None


def stale_steps(local: LocalTier, durable: DurableTier, *, run_id: str, upto: int, keep_last: int) -> list[Stale]:
    """The steps to heal, newest first (see the module)."""
    mine = [
        e
        for e in catalog.scan(local)
        if e.manifest is not None and e.manifest.is_global and e.manifest.run_id == run_id and e.step <= upto
    ][:keep_last]
    there = {e.step: e for e in catalog.scan(durable)}
    found = []
    for entry in mine:
        copy = there.get(entry.step)
        if copy is None:
            found.append(Stale(entry, "no copy"))
        elif copy.problem == catalog.NOT_COMMITTED:
            found.append(Stale(entry, "no manifest"))
        elif copy.manifest is not None and copy.manifest.run_id == run_id:
            damage = catalog.damage(copy)
            if damage is not None:
                found.append(Stale(entry, f"file {damage[0].path} {damage[1]}", copy))
        # else another run's step, or a manifest this release cannot read: not ours to replace
    return found


def heal(
    local: LocalTier,
    durable: DurableTier,
    *,
    run_id: str,
    upto: int,
    writer: Writer,
    settings: HealSettings,
    stopped: threading.Event | None = None,
) -> list[int]:
    """Upload the stale steps again (see the module), newest first; the steps healed. ``writer``: the owner
    record of the job that holds the durable lease. A failure ends the healing with a warning (the local copies
    stay; the next start tries again); ``stopped`` ends it before the next step."""
    client_retries.watch(durable)
    stale = stale_steps(local, durable, run_id=run_id, upto=upto, keep_last=settings.keep_last)
    if not stale:
        return []
    log.warning(
        "the durable tier %s lacks this run's step(s) %s, which this node's local tier holds: uploading them again "
        "in the background",
        durable.url,
        ", ".join(f"{s.local.step} ({s.why})" for s in stale),
    )
    fence = (DurableGuard(durable), {**writer, HEALING: True})
    healed = []
    for item in stale:
        if stopped is not None and stopped.is_set():
            break
        try:
            _heal_one(item, local, durable, fence, settings)
        except Exception as exc:  # the healing must never stop training: the next start tries again
            if not local.exists(item.local.path):  # newer saves came, and retention let this one go
                log.info("%s was deleted by retention before it was healed", item.local.where())
                continue
            log.warning("healing %s failed, so it stays on the local tier only: %s", item.local.where(), describe(exc))
            break
        healed.append(item.local.step)
    if healed:
        log.info("healed the durable tier %s: step(s) %s uploaded again", durable.url, ", ".join(map(str, healed)))
    return healed


def _heal_one(
    item: Stale, local: LocalTier, durable: DurableTier, fence: tuple[DurableGuard, Writer], settings: HealSettings
) -> None:
    """Set a damaged durable copy aside (fenced), then push the local step."""
    damaged = item.damaged
    if damaged is not None:
        guarded(fence, damaged.step, "setting aside a damaged copy", lambda *_: set_aside(damaged), settings.policy)
    push_step(
        local,
        durable,
        item.local,
        concurrency=settings.concurrency,
        policy=settings.policy,
        fence=fence,
        trust_proofs=True,
    )


def set_aside(copy: catalog.Entry) -> None:
    """Take a damaged durable copy out of discovery as a resume does: its manifest renamed, nothing deleted."""
    copy.tier.rename(f"{copy.path}/{MANIFEST}", f"{copy.path}/{CORRUPT_MANIFEST}{time.strftime('%Y%m%dT%H%M%S')}")


class Healer:
    """:func:`heal` in a thread of its own, started at once; :meth:`stop` ends it before its next step."""

    def __init__(
        self,
        local: LocalTier,
        durable: DurableTier,
        settings: HealSettings,
        *,
        run_id: str,
        upto: int,
        writer: Writer,
    ):
        self.healed: list[int] = []
        self._stopped = threading.Event()

        def run() -> None:
            try:
                self.healed = heal(
                    local, durable, run_id=run_id, upto=upto, writer=writer, settings=settings, stopped=self._stopped
                )
            except Exception as exc:  # listing a tier failed: nothing was changed
                log.warning(
                    "checking the durable tier %s against the local tier failed: %s", durable.url, describe(exc)
                )

        self._thread = threading.Thread(target=run, name="resilience-heal", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the healing to end; whether it did within ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
