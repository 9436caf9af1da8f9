"""The engines open in this process, and what becomes of them when the script ends or its generation does.

A save made just before the script ends still commits: the main thread's end waits for it. Before a restart in
place (:mod:`resilience.recovery.inplace`) the generation's engines are closed without collectives instead, their
peers being gone. Nothing here imports torch: the launcher's side may import this module.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  # imported before our exit hook is registered: see _register_exit_hook
import functools
import logging
import os
import threading
import weakref
from typing import Protocol

from resilience.errors import describe

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What this module does with an open :class:`~resilience.checkpoint.manager.CheckpointManager`."""

    exit_timeout_s: float | None

    def pending_steps(self) -> list[int]: ...

    def close(self, timeout: float | None = None) -> None: ...

    def abandon(self) -> None: ...


_OPEN: weakref.WeakSet[Engine] = weakref.WeakSet()
# A forked child (a DataLoader worker) inherits the open engines, and threading's exit hooks run when it ends:
# closing them there would close the parent's helper over the inherited connection. They are not the child's.
os.register_at_fork(after_in_child=_OPEN.clear)


def opened(engine: Engine) -> None:
    """``engine`` is open: the process exit waits for its saves."""
    _OPEN.add(engine)
    _register_exit_hook()


def closed(engine: Engine) -> None:
    _OPEN.discard(engine)


def abandon_open() -> None:
    """Before a restart in place: the generation's engines still open are closed without collectives."""
    for engine in list(_OPEN):
        engine.abandon()


@functools.cache
def _register_exit_hook() -> None:
    """Run :func:`_finish_at_exit` when the main thread ends (cached: registered once per process).

    Threading's exit hooks run before any ``atexit`` one, while every thread and the process group still live
    (Lightning destroys its group in an ``atexit`` hook), and in reverse order of registration: registered after
    ``concurrent.futures.thread`` is imported, this one runs before that module's own, which refuses new work
    from then on (an upload started at exit failed with "cannot schedule new futures after interpreter
    shutdown", its checkpoint committed locally only). ``threading._register_atexit`` is private, but the
    standard library's executors use it for exactly this.
    """
    threading._register_atexit(_finish_at_exit)  # type: ignore[attr-defined]


def _finish_at_exit() -> None:
    """A save made just before the script ends still commits: the exit waits for it, and says so.

    Without this the interpreter would tear the writer threads down mid-write (a save outside ``fit()``,
    followed by the end of the script, was lost that way, with an abort in the threads' gloo calls).
    """
    for engine in list(_OPEN):
        pending = engine.pending_steps()
        if pending:
            log.warning("waiting for checkpoint step(s) %s to commit before the process exits", pending)
            print(
                f"training-resilience: waiting for checkpoint step(s) {pending} to commit before exit",
                flush=True,
            )
        try:
            engine.close(engine.exit_timeout_s)
        except Exception as exc:
            log.error("a checkpoint failed while the process was exiting: %s", describe(exc))
