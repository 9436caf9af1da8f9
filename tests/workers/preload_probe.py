"""A module a test's spare preloads (``--preload``): it keeps the CPU priority of the thread that imported it, for
the rank the spare becomes to print."""

from __future__ import annotations

import os
import threading

NICE = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
