"""torch's DataLoader workers through a stop signal sent to every process of the job.

A worker dies of any SIGTERM its parent did not send (torch's own handler, in C), and of SIGINT and SIGUSR1 too.
Under SLURM, torchrun or a terminal the job's stop signal reaches the workers with the training process, so the
next batch the training process draws fails ("DataLoader worker exited unexpectedly"; with the default sharing
of tensors through file descriptors, even the batches already made are lost with their worker), and the run ends
with that error before its next step boundary, where the emergency save would have been made.

While the pack watches the stop signals, workers started from then on keep torch's rule for their parent (its
SIGTERM ends a worker at once, as ``terminate()`` at shutdown expects) and outlast everyone else's: they go on
handing out batches until the training process stops at its boundary and shuts them down, or dies (torch's
workers watch their parent and leave when it is gone). This reaches the workers forked from the training
process (the default start method on Linux before Python 3.14); workers of a ``spawn`` or ``forkserver``
context import torch afresh and die as before (docs/HEALTH.md).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any


def outlast_stop_signals() -> None:
    """In a loader worker: from now on a stop signal from the parent ends it (exit 0, as torch's handler does),
    and one from anybody else is dropped. The signals are blocked in this thread (threads started later inherit
    that) and taken by a waiting thread, which sees who sent each."""
    from resilience.health.signals import STOP_SIGNALS

    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_pid == parent or os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=wait, name="resilience-stop-signals", daemon=True).start()


def protect() -> None:
    """Workers started from now on outlast the job's stop signals (idempotent)."""
    from torch.utils.data._utils import signal_handling

    current = getattr(signal_handling, "_set_worker_signal_handlers", None)
    if current is None or getattr(current, "__wrapped__", None) is not None:
        return  # a torch without this hook: its workers die of the signal as before (docs/HEALTH.md)

    def set_worker_signal_handlers(*args: Any) -> None:
        current(*args)  # torch's, for SIGSEGV, SIGBUS, SIGFPE and its parent's SIGTERM
        outlast_stop_signals()

    set_worker_signal_handlers.__wrapped__ = current  # type: ignore[attr-defined]
    signal_handling._set_worker_signal_handlers = set_worker_signal_handlers


def unprotect() -> None:
    """Workers started from now on die of stop signals again, as torch has them."""
    from torch.utils.data._utils import signal_handling

    current = getattr(signal_handling, "_set_worker_signal_handlers", None)
    original: Callable[..., None] | None = getattr(current, "__wrapped__", None)
    if original is not None:
        signal_handling._set_worker_signal_handlers = original
