"""A module a test's spare preloads (``--preload``): it keeps the CPU priority of the thread that imported it, and
starts a thread of its own as numpy's BLAS pool does at import, for the rank the spare becomes to print both."""

from __future__ import annotations

import os
import threading

NICE = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
_started = threading.Event()
_pool = threading.Thread(target=lambda: (_started.set(), threading.Event().wait()), daemon=True)
_pool.start()
_started.wait()
POOL_THREAD = _pool.native_id
