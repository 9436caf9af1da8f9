"""Moving a committed checkpoint's files to the durable tier: concurrent, retried, committed last.

Shared by the background uploader (each rank its own files), and for a whole checkpoint by ``resilience upload``
(e.g. one whose upload a crash cut short) and by the healing of the durable tier at start
(:mod:`resilience.persist.heal`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fsspec.callbacks import Callback

from resilience.errors import CheckpointError, describe
from resilience.storage import catalog
from resilience.storage.fencing import DurableGuard
from resilience.storage.layout import LEASE_DIR, MANIFEST, step_dirname
from resilience.storage.manifest import FileEntry
from resilience.storage.proofs import Proofs
from resilience.storage.tiers import Tier

log = logging.getLogger(__name__)

OnRetry = Callable[[str, int, BaseException], None]
Writer = dict[str, Any]  # the uploader's owner record, as its .writer.json holds it
Guarded = Callable[[DurableGuard, Writer], None]
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts beyond the first, and the first delay (doubling per attempt, with jitter, capped at 30 s)."""

    retries: int = 5
    backoff_s: float = 0.5


def retrying(name: str, action: Callable[[], T], policy: RetryPolicy, on_retry: OnRetry | None = None) -> T:
    """Run one transfer until it succeeds and return its result; errors a retry cannot fix (missing file, no
    permission, a refusal of the engine's own) end it at once."""
    attempt = 0
    while True:
        try:
            return action()
        except (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, CheckpointError):
            raise
        except Exception as exc:
            attempt += 1
            if attempt > policy.retries:
                raise OSError(f"{name}: gave up after {attempt} attempts ({describe(exc)})") from exc
            delay = min(30.0, policy.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            log.warning("transfer of %s failed (%s); retry %d in %.1fs", name, describe(exc), attempt, delay)
            if on_retry is not None:
                on_retry(name, attempt, exc)
            time.sleep(delay)


def upload_files(
    local: Tier,
    durable: Tier,
    step: int,
    entries: Iterable[FileEntry],
    *,
    concurrency: int,
    policy: RetryPolicy,
    on_retry: OnRetry | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Copy ``entries`` of ``step-<step>`` from ``local`` to ``durable``, ``concurrency`` files at a time.

    ``on_bytes`` hears of every chunk sent (a retried file's bytes are taken back first), for progress.
    """

    def put(entry: FileEntry) -> None:
        source, target = local.step_path(step, entry.path), durable.step_path(step, entry.path)
        sent = _Sent(on_bytes)

        def attempt() -> None:
            sent.restart()
            durable.put_file(source, target, callback=sent)

        retrying(entry.path, attempt, policy, on_retry)
        sent.finish(entry.size)

    with ThreadPoolExecutor(concurrency, thread_name_prefix="resilience-put") as pool:
        for future in [pool.submit(put, entry) for entry in entries]:
            future.result()


class _Sent(Callback):
    """Counts one file's bytes for ``on_bytes``, whether or not the backend reports chunks as it sends them."""

    def __init__(self, on_bytes: Callable[[int], None] | None):
        super().__init__()
        self.on_bytes = on_bytes
        self.sent = 0

    def relative_update(self, inc: int = 1) -> None:
        self.sent += inc
        if self.on_bytes is not None:
            self.on_bytes(inc)

    def restart(self) -> None:
        if self.sent and self.on_bytes is not None:
            self.on_bytes(-self.sent)
        self.sent = 0

    def finish(self, size: int) -> None:
        if size > self.sent:  # a backend that reports nothing: the whole file at the end
            self.relative_update(size - self.sent)


def commit_durable(
    durable: Tier, step: int, manifest: bytes, policy: RetryPolicy, on_retry: OnRetry | None = None
) -> None:
    """Write the durable manifest once, retried like the files: a store's error or throttling response to this
    one small PUT must not cost the commit of everything uploaded before it."""
    path = durable.step_path(step, MANIFEST)

    def write() -> None:
        try:
            durable.write_exclusive(path, manifest)
        except FileExistsError:
            # An earlier attempt (ours, or the client library's after a timeout) landed but its response was
            # lost. The manifest holds this upload's own timings, so equal bytes mean it is ours. (A listing the
            # filesystem object remembers from before that write would say the file is not there.)
            durable.forget(path)
            if durable.read_bytes(path) != manifest:
                raise

    retrying(MANIFEST, write, policy, on_retry)


def guarded(
    fence: tuple[DurableGuard, Writer],
    step: int,
    what: str,
    then: Guarded,
    policy: RetryPolicy,
    on_retry: OnRetry | None = None,
) -> None:
    """Before a change to the durable tier: the job whose writer record ``fence`` holds must still hold the
    durable URL (else :class:`CheckpointError`); then ``then``. Both retried like transfers."""
    guard, writer = fence
    token = str(writer.get("token"))
    retrying(LEASE_DIR, lambda: guard.check_held(token, f"{what} of step {step}"), policy, on_retry)
    retrying(step_dirname(step), lambda: then(guard, writer), policy, on_retry)


def push_step(
    local: Tier,
    durable: Tier,
    entry: catalog.Entry,
    *,
    concurrency: int,
    policy: RetryPolicy,
    fence: tuple[DurableGuard, Writer] | None = None,
    trust_proofs: bool = False,
    on_retry: OnRetry | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Upload one committed local step whole, then commit it in ``durable`` with its manifest, written last.

    Every file is checked against its manifest first, so a corrupt checkpoint is never spread to the durable
    tier; with ``trust_proofs``, shards this node proved unchanged since it hashed them are not hashed again
    (:mod:`resilience.storage.proofs`). With ``fence`` (a :class:`DurableGuard` and the writer record of a job
    that holds the durable lease), the job must still hold the URL before the upload and before the commit,
    and the step's durable folder is made its own first: a committed step is refused, never written into.
    """
    manifest = entry.manifest
    if manifest is None:
        raise CheckpointError(f"{entry.where()} is not committed: only committed steps are uploaded", step=entry.step)
    catalog.verify(entry, full=True, proven=Proofs(entry.path) if trust_proofs else None)
    step = entry.step
    if fence is not None:
        guarded(fence, step, "the upload", lambda guard, writer: guard.open_step(step, writer), policy, on_retry)
    upload_files(
        local,
        durable,
        step,
        manifest.files,
        concurrency=concurrency,
        policy=policy,
        on_retry=on_retry,
        on_bytes=on_bytes,
    )
    if fence is not None:
        guarded(fence, step, "the commit", lambda guard, _: guard.check_uploaded(step, manifest), policy, on_retry)
    commit_durable(durable, step, local.read_bytes(f"{entry.path}/{MANIFEST}"), policy, on_retry)
    if fence is not None:
        fence[0].close_step(step)
