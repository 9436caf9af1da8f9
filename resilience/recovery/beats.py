"""Whether a process on another machine is alive, told without comparing clocks: watch its beat counter move.

A record that only its owner rewrites (an owner record in a local root, a lease in a durable URL) carries a
counter the owner's heartbeat thread raises every :data:`BEAT_S` seconds. Another machine cannot look at that
process, and a file's modification time is set by the writer's (or the file server's) clock, which may run
minutes or hours apart from ours: a node with a fast clock would take a live job's record for an old one. So a
contender reads the counter, waits up to :data:`WATCH_S` seconds on its own monotonic clock, and reads it again:
it moved, the owner lives; it did not, the owner is gone. No two clocks are ever compared.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)

BEAT_S = 10.0  # how often a live owner raises its counter
WATCH_S = 60.0  # how long a contender watches a counter before it calls the owner gone (several beats)


def still_beating(read: Callable[[], Mapping[K, object]], watch_s: float | None = None) -> set[K]:
    """The keys whose beat changes within ``watch_s`` (default :data:`WATCH_S`), measured on the monotonic clock.

    ``read`` returns each watched record's current beat (any comparable value; a record that is gone is left
    out, and counts as not beating). Returns as soon as every record has been seen to move, so a live owner
    costs a contender about one beat period, a gone one the whole window.
    """
    window = WATCH_S if watch_s is None else watch_s
    first = dict(read())
    moved: set[K] = set()
    deadline = time.monotonic() + window
    poll = max(0.05, min(BEAT_S, window) / 4)
    while set(first) - moved:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(poll, left))
        now = read()
        moved |= {key for key, beat in first.items() if key in now and now[key] != beat}
    return moved


class Heartbeat:
    """A daemon thread that calls each beat function every :data:`BEAT_S` seconds until :meth:`stop`.

    A beat that fails (an unreachable store) is logged once until one succeeds again: the record then stops
    moving, and a contender may take it for gone, which fencing makes safe (see :mod:`resilience.storage.lease`).
    """

    def __init__(self, beats: list[Callable[[], None]]):
        self._beats = beats
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: set[int] = set()

    def start(self) -> None:
        if self._thread is not None or not self._beats:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="resilience-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (a beat in progress finishes first); :meth:`start` makes a new one."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            for index, beat in enumerate(self._beats):
                try:
                    beat()
                except Exception as exc:
                    if index not in self._failing:
                        log.warning(
                            "a liveness beat failed (%s: %s); retrying every %ss", type(exc).__name__, exc, BEAT_S
                        )
                    self._failing.add(index)
                else:
                    self._failing.discard(index)
