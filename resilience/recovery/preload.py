"""A warm spare's imports, kept off the cores the training ranks use.

A spare starts while the ranks of its node train, and imports what their script imports: seconds of CPU, which on
a node with few cores come out of the steps. So the imports run in a thread at the lowest CPU priority (Linux keeps
a nice value per thread) and take only what training leaves idle. A thread the imports start (numpy's BLAS pool,
say) takes that priority from the thread that started it; each is put back to the process's own afterwards, so the
rank the spare becomes runs every thread as the other ranks do. Putting a priority back needs CAP_SYS_NICE or an
RLIMIT_NICE that allows it: where neither does, the imports run at the process's own priority, as a cold start's
would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)
LOWEST_PRIORITY = 19  # the highest nice value


def preload(modules: Iterable[str]) -> None:
    """Import ``modules`` (see the module's docstring), each that can be."""
    names = list(modules)
    lower = _may_put_back()
    before = _threads()
    thread = threading.Thread(target=_imports, args=(names, lower), name="resilience-preload", daemon=True)
    thread.start()
    thread.join()
    if lower:
        own = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's: the one that runs the rank
        for tid in _threads() - before:
            with contextlib.suppress(OSError):  # ended meanwhile
                os.setpriority(os.PRIO_PROCESS, tid, own)


def _imports(names: list[str], lower: bool) -> None:
    if lower:
        with contextlib.suppress(OSError):  # then at the process's own priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    for name in names:
        try:
            __import__(name)
        except BaseException as exc:  # one that cannot be imported before its rank is known: left to the script
            log.debug("spare: preloading %s failed: %s", name, exc)


def _may_put_back() -> bool:
    """Whether a thread of this process may have its priority lowered and put back: tried on a thread of its own."""
    allowed: list[bool] = []

    def attempt() -> None:
        tid = threading.get_native_id()
        with contextlib.suppress(OSError, AttributeError):  # AttributeError: no setpriority (not Unix)
            own = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST_PRIORITY)
            os.setpriority(os.PRIO_PROCESS, tid, own)
            allowed.append(True)

    thread = threading.Thread(target=attempt, name="resilience-priority-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(allowed)


def _threads() -> set[int]:
    """This process's threads (Linux), by id."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()
