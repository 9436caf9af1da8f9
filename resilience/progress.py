"""A line every so often while something long runs, so that a person watching knows it is not stuck."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

EVERY_S = 30.0


@contextlib.contextmanager
def still_going(what: str, *, every_s: float = EVERY_S, enabled: bool = True) -> Iterator[None]:
    """While the block runs, log ``"<what>: N s so far"`` every ``every_s`` seconds (nothing for a short block).

    A restore from object storage can read for minutes before its one closing line; without a word in between, a
    user cannot tell a slow read from a hung one.
    """
    if not enabled:
        yield
        return
    done = threading.Event()
    began = time.monotonic()

    def report() -> None:
        while not done.wait(every_s):
            log.info("%s: %.0f s so far", what, time.monotonic() - began)

    thread = threading.Thread(target=report, name="resilience-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
