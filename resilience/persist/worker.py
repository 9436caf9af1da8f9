"""A background queue whose thread exists only while there is work.

Nothing is left running after the last job (a test harness, or a user, looking for stray threads finds none);
the next job starts a new thread. For collectives this is safe: each rank's worker handles the same jobs in
the same order, whichever thread it is, so the ranks' calls stay matched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Worker:
    """A queue with a thread that runs while there is work, and ends when there is none.

    Args:
        name: The thread's name.
        handle: Called with the queue (under no lock) while it is not empty; it takes what it handles out.
    """

    def __init__(self, name: str, handle: Callable[[list[Any]], None]):
        self.name = name
        self.items: list[Any] = []
        self.cond = threading.Condition()
        self._handle = handle
        self._thread: threading.Thread | None = None
        self._last: threading.Thread | None = None  # the thread last started: once it ended, join() joins it

    def put(self, item: Any) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()
            if self._thread is None:
                self._thread = self._last = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.items:
                    self._thread = None
                    self.cond.notify_all()
                    return
            self._handle(self.items)

    def join(self, timeout: float | None) -> bool:
        """Wait until the queue is empty and the thread gone; False if that took longer than ``timeout``.

        Gone from ``threading.enumerate()`` too (a framework's check for threads left behind looks there): the
        thread has left its loop, and only its return is left to wait for.
        """
        with self.cond:
            if not self.cond.wait_for(lambda: self._thread is None, timeout):
                return False
            ended = self._last
        if ended is not None:
            ended.join()
        return True
