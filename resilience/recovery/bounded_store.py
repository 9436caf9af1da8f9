"""The launcher's store with every call bounded in time, dead connection or not.

A TCP peer cut off by a partition never answers and never closes: a call to a store whose host is unreachable
blocks for as long as the kernel keeps retransmitting (about 15 minutes on Linux), whatever timeout the store was
given (torch's ``TCPStore`` bounds its waits for a key, not every read of an answer). So each call runs under a
watch: a small thread that, when a call has not returned ``timeout_s`` after it began, reports the store lost
(``on_lost``) from there. The call itself never returns in time to matter: ``on_lost`` ends what depends on the
store (the node's ranks) and the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
_CALLS = ("set", "get", "add", "check", "wait", "compare_set", "delete_key")


class BoundedStore:
    """``store``'s calls (:data:`_CALLS`), each watched; ``on_lost(call, seconds)`` runs once, on the watch's thread.

    ``wait`` calls that give their own timeout are bounded by it plus ``timeout_s``.
    """

    def __init__(self, store: Any, timeout_s: float, on_lost: Callable[[str, float], None]):
        self.store = store
        self.timeout_s = timeout_s
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._call: tuple[str, float, float] | None = None  # the outermost call under way: name, start, its limit
        self._reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="resilience-store-watch", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)
        if name not in _CALLS:
            return method

        def bounded(*args: Any, **kwargs: Any) -> Any:
            limit = self.timeout_s + _own_timeout(args, kwargs)
            with self._lock:
                outer = self._call is None
                if outer:
                    self._call = (name, time.monotonic(), limit)
            try:
                return method(*args, **kwargs)
            finally:
                if outer:
                    with self._lock:
                        self._call = None

        return bounded

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            with self._lock:
                call = self._call
            if call is None or self._reported:
                continue
            name, began, limit = call
            waited = time.monotonic() - began
            if waited > limit:
                self._reported = True
                self._on_lost(name, waited)


def _own_timeout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """The seconds a call's own timeout (a ``timedelta`` argument, as ``wait(keys, timeout)`` takes) allows."""
    for value in (*args, *kwargs.values()):
        seconds = getattr(value, "total_seconds", None)
        if callable(seconds):
            return float(seconds())
    return 0.0
