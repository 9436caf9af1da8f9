"""The manager's events (``local_commit``, ``durable_commit``, ``failed``, ...), for metrics and adapters.

Listeners are called from the thread where the event happened (the writer or uploader thread, mostly), so
they must be quick and thread-safe; one that raises is logged and skipped, never allowed to break a save.
Listeners added at any time receive every later event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
Listener = Callable[[dict[str, Any]], None]


class SaveEvents:
    """A list of listeners and the one method that calls them."""

    def __init__(self, rank: int, listeners: list[Listener] | None = None):
        self.rank = rank
        self._listeners: list[Listener] = list(listeners or [])
        self._lock = threading.Lock()

    def add(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove(self, listener: Listener) -> None:
        with self._lock:
            self._listeners = [other for other in self._listeners if other is not listener]

    def emit(self, event: str, step: int, **fields: Any) -> None:
        record = {"event": event, "step": step, "rank": self.rank, "time": time.time(), **fields}
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(record)
            except Exception:  # a broken listener must not break checkpointing
                log.exception("checkpoint listener failed on %s", event)
