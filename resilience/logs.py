"""The pack's log lines, out the way the framework's own lines go.

Without a logging set-up of the user's (which then takes the pack's lines, as it takes the framework's), the
pack's lines would go out through Python's last-resort handler: WARNING and above only, from every rank, and
deaf to the level the user gave the framework's logger. An adapter routes them through that logger instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable


class _Through(logging.Handler):
    """Hands each record to the ``target`` logger (its handlers and level); INFO only where ``is_main()``, while
    warnings (e.g. of a survivor save, which are rank-specific) come from every rank."""

    def __init__(self, target: str, is_main: Callable[[], bool]):
        super().__init__()
        self.target = target
        self.is_main = is_main

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(self.target)
        if (record.levelno >= logging.WARNING or self.is_main()) and target.isEnabledFor(record.levelno):
            target.handle(record)


class _Stderr(logging.StreamHandler):
    """The pack's lines on stderr, ``resilience: ...``: INFO only where ``is_main()``, warnings from every rank."""

    def __init__(self, is_main: Callable[[], bool]):
        super().__init__()
        self.is_main = is_main
        self.setFormatter(logging.Formatter("resilience: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or self.is_main():
            super().emit(record)


def rank_zero() -> bool:
    """Whether this process is the job's rank 0, asked of torch.distributed (or ``RANK``) and of nothing that lives
    shorter than the process: a handler stays installed across a restart in place, and asking a framework object
    of an earlier generation (an old Accelerator) would set the framework's singletons up again, as of then."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0") or 0) == 0


def route_through(target: str, is_main: Callable[[], bool]) -> None:
    """Send the engine's records (the ``resilience`` logger's) through the ``target`` logger, unless the user
    set up logging; once."""
    _install(_Through(target, is_main))


def print_to_stderr(is_main: Callable[[], bool]) -> None:
    """For a framework whose own lines stay silent without a logging set-up (Accelerate's): the engine's records
    go to stderr, so that a resume, a save that failed or a stop is seen; unless the user set up logging; once."""
    _install(_Stderr(is_main))


def _install(handler: logging.Handler) -> None:
    engine = logging.getLogger("resilience")
    if logging.getLogger().hasHandlers() or any(isinstance(h, (_Through, _Stderr)) for h in engine.handlers):
        return
    engine.addHandler(handler)
    engine.propagate = False
    if engine.level == logging.NOTSET:  # else the root's WARNING would drop INFO before the handler
        engine.setLevel(logging.INFO)
