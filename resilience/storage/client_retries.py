"""Requests the storage client tried again on its own: throttling and errors that never reach the engine.

An object store under load answers ``503 SlowDown``; botocore retries such an answer (and server errors, and
lost connections) a few times, and s3fs retries again around botocore, before the engine's own retry sees a
failure. An upload that ends well after many such retries looks healthy, while it is slower than it should be
and the store is telling the job to back off. So every answer of that kind is counted here, through botocore's
event system on the client s3fs made (``response-received``, emitted once per attempt, retries included), and
the pipeline reports the count with its uploads (:mod:`resilience.goodput.telemetry` shows it).

Only s3fs clients are watched; other backends count nothing. The count is per process: the uploads of a rank run
in one process (its helper, or its threads).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from resilience.storage.tiers import Tier

log = logging.getLogger(__name__)

# Answers a client retries: throttling, and the store's own failures.
RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})
THROTTLING_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException"}
)
_MARK = "_resilience_retries_counted"


class _Count:
    """The process's count, raised from the storage client's event loop thread, read from the uploader's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self) -> None:
        with self._lock:
            self.value += 1


_COUNT = _Count()


def counted_answer(response_dict: Any = None, parsed_response: Any = None, exception: Any = None, **_: Any) -> None:
    """botocore's ``response-received`` handler: one attempt's answer; a retried kind of answer is counted."""
    status = response_dict.get("status_code") if isinstance(response_dict, dict) else None
    error = parsed_response.get("Error") if isinstance(parsed_response, dict) else None
    code = error.get("Code") if isinstance(error, dict) else None
    if exception is not None or status in RETRIED_STATUS or code in THROTTLING_CODES:
        _COUNT.add()


def watch(tier: Tier) -> None:
    """Count the retried answers ``tier``'s storage client gets from now on (s3fs only; idempotent, and cheap
    enough to call before every upload: s3fs makes a new client when its connections were closed)."""
    fs = tier.fs
    if type(fs).__name__ != "S3FileSystem" or getattr(fs, "asynchronous", False):
        return
    try:
        events = fs.connect().meta.events
    except Exception as exc:  # counting must never fail an upload: the upload itself says what is wrong
        log.debug("storage retries are not counted for %s: %s", tier.url, exc)
        return
    if not getattr(events, _MARK, False):
        events.register("response-received.s3", counted_answer)
        setattr(events, _MARK, True)


class Tally:
    """What the process's count rose by since the last :meth:`take` (one per uploader)."""

    def __init__(self) -> None:
        self._seen = _COUNT.value

    def take(self) -> int:
        now = _COUNT.value
        new, self._seen = now - self._seen, now
        return new
