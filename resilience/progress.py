"""A line every so often while something long runs, so that a person watching knows it is not stuck; sizes
in words for such lines."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

EVERY_S = 30.0


@contextlib.contextmanager
def still_going(
    what: str, *, every_s: float = EVERY_S, enabled: bool = True, detail: Callable[[], str] | None = None
) -> Iterator[None]:
    """While the block runs, log ``"<what>: N s so far"`` every ``every_s`` seconds (nothing for a short block),
    with ``detail()`` (e.g. the bytes done) before the seconds.

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
            done_yet = f"{detail()}, " if detail is not None else ""
            log.info("%s: %s%.0f s so far", what, done_yet, time.monotonic() - began)

    thread = threading.Thread(target=report, name="resilience-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def size_text(n: float) -> str:
    """``512 B``, ``1.5 MiB``: a byte count for people."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
