"""Keeping one job's changes off another job's steps: the uploader's checks, and which steps retention may touch.

The uploader (rank 0's, maybe in a helper process) changes the durable tier only while its job holds the lease
(:mod:`resilience.storage.lease`): before a step's files go up, before its manifest is written, before each deletion.
A step directory is also checked on its own: a committed one is never written into, and files that a writer
who no longer holds the lease left behind are cleared before the upload, not mixed with it. After the upload
the directory's listing must show every file at the size the manifest gives, or nothing is committed.

Retention counts and deletes only the job's own steps: committed ones whose manifest carries its run id (a
resumed run keeps the run id it resumed, so its lineage is its own), and uncommitted directories whose
``.writer.json`` (there until the commit, in both tiers) names that run id. In the local tier, whose owner
record keeps other jobs out, also uncommitted ones that name no one: leftovers of an interrupted deletion.
Another run's steps are neither deleted nor counted.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable

from resilience.errors import CheckpointError
from resilience.storage.catalog import NOT_COMMITTED, Entry
from resilience.storage.layout import MANIFEST, WRITER_FILE
from resilience.storage.lease import Fence
from resilience.storage.manifest import Manifest
from resilience.storage.owners import Owner
from resilience.storage.tiers import Tier

log = logging.getLogger(__name__)


def read_writer(tier: Tier, directory: str) -> Owner | None:
    """Who wrote (or writes) a step directory, from its ``.writer.json``; None when it names no one."""
    try:
        return Owner.from_json(json.loads(tier.read_bytes(f"{directory}/{WRITER_FILE}")))
    except (FileNotFoundError, ValueError):
        return None


def foreign_steps(tier: Tier, entries: Iterable[Entry], run_id: str) -> set[int]:
    """Steps of ``entries`` that are not this run's to count or delete (see the module's description)."""
    foreign = set()
    for entry in entries:
        if entry.manifest is not None:
            mine = entry.manifest.run_id == run_id
        elif entry.problem == NOT_COMMITTED:
            writer = read_writer(tier, entry.path)
            mine = writer.run_id == run_id if writer is not None else tier.is_local
        else:
            mine = False  # a manifest this release cannot read: perhaps a newer release's, never ours to delete
        if not mine:
            foreign.add(entry.step)
    return foreign


HEALING = "healing"  # in a durable .writer.json: the step is uploaded again from a local copy (heal.py)


def being_healed(tier: Tier, entries: Iterable[Entry], token: object) -> set[int]:
    """Uncommitted steps of ``entries`` that the job with ``token`` is uploading again to heal the durable tier
    (:mod:`resilience.persist.heal`): retention leaves them, as it leaves the pipeline's own uploads in flight."""
    found = set()
    for entry in entries:
        if entry.problem != NOT_COMMITTED:
            continue
        try:
            body = json.loads(tier.read_bytes(f"{entry.path}/{WRITER_FILE}"))
        except (FileNotFoundError, ValueError):
            continue
        if isinstance(body, dict) and body.get(HEALING) is True and body.get("token") == token:
            found.add(entry.step)
    return found


class DurableGuard:
    """The uploader's checks before it changes the durable tier; ``token`` names the job (its owner's)."""

    def __init__(self, durable: Tier):
        self.durable = durable
        self.fence = Fence(durable)

    def check_held(self, token: str, what: str) -> None:
        """Raise :class:`CheckpointError` unless the job with ``token`` still holds the lease (always held on a
        process-local file system: nobody else can write there)."""
        if self.durable.process_local:
            return
        self.fence.judge(self.fence.newest(), token, what)

    def open_step(self, step: int, writer: dict[str, object]) -> None:
        """Make ``step``'s durable directory this job's to upload into (call again after a failure: idempotent).

        Refuses a committed step; clears what a writer that no longer holds the lease left there; then names
        this job in ``.writer.json``.
        """
        token = str(writer.get("token"))
        self.check_held(token, f"the upload of step {step}")
        path = self.durable.step_path(step)
        self.durable.forget(path)
        files = self.durable.file_sizes(path)
        if MANIFEST in files:
            raise CheckpointError(
                f"step {step} is already committed in the durable tier ({self.durable.display(path)}), by "
                f"run {_run_of(self.durable, path)}; committed checkpoints are never overwritten"
            )
        before = read_writer(self.durable, path) if files else None
        if before is not None and before.token == token:
            return  # this job's own upload, tried again
        if files:
            left = (
                f"an unfinished upload by {before.describe()}, which no longer holds the durable URL"
                if before is not None
                else "no manifest holds them (it was deleted, or their upload cut short, or a damaged copy set aside)"
            )
            log.warning("clearing %d file(s) of step %s in %s: %s", len(files), step, self.durable.display(path), left)
            self.durable.remove_dir(path)
        self.durable.write_replace(f"{path}/{WRITER_FILE}", json.dumps(writer).encode())

    def close_step(self, step: int) -> None:
        """After the commit: the step is the manifest's now; its ``.writer.json`` goes (as the local tier's does)."""
        with contextlib.suppress(Exception):
            self.durable.remove_file(self.durable.step_path(step, WRITER_FILE))

    def check_uploaded(self, step: int, manifest: Manifest) -> None:
        """Every file of ``manifest`` is in the durable directory at its size: nothing else wrote over them."""
        path = self.durable.step_path(step)
        self.durable.forget(path)
        sizes = self.durable.file_sizes(path)
        for entry in manifest.files:
            found = sizes.get(entry.path)
            if found != entry.size:
                raise CheckpointError(
                    f"after the upload {entry.path} is {'missing' if found is None else f'{found} bytes'} in the "
                    f"durable tier, the manifest says {entry.size}: another process wrote into this step, which is "
                    "not committed"
                )


def _run_of(tier: Tier, path: str) -> str:
    try:
        body = json.loads(tier.read_bytes(f"{path}/{MANIFEST}"))
    except (FileNotFoundError, ValueError):
        return "unknown"
    return str(body.get("run_id")) if isinstance(body, dict) else "unknown"
