"""Moving a committed checkpoint's files to the durable tier: concurrent, retried, committed last.

Shared by the background uploader (each rank its own files) and ``resilience upload`` (a whole checkpoint
from the command line, e.g. one whose upload a crash cut short).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from fsspec.callbacks import Callback

from resilience.errors import CheckpointError, describe
from resilience.storage.layout import MANIFEST
from resilience.storage.manifest import FileEntry
from resilience.storage.tiers import Tier

log = logging.getLogger(__name__)

OnRetry = Callable[[str, int, BaseException], None]
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
