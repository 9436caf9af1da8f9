"""Whether this process has decided to leave, and with which exit code.

A stop signal's handler decides it (:func:`resilience.health.signals.hold_exit_code`) and raises ``SystemExit``
wherever the main thread is. Code that catches every ``BaseException`` can swallow that exit: DCP's load does, on
each rank, and hands the ``SystemExit`` back inside a ``CheckpointException``, or loses it when its own collective
then fails because another rank has already left. So a failure seen while the process is leaving is taken for
what it is: the way out, never evidence against the checkpoint being read.
"""

from __future__ import annotations

_code: int | None = None


def decide(code: int) -> None:
    """The process leaves with ``code`` (the first decision holds)."""
    global _code
    if _code is None:
        _code = code


def cancel() -> None:
    """The process stays after all (a stop decided, then called off by its caller, as tests do in-process)."""
    global _code
    _code = None


def decided() -> int | None:
    """The exit code decided, or None while the process is not leaving."""
    return _code


def leave_if_decided() -> None:
    """Raise the decided ``SystemExit`` again, if there is one: call it where a failure is about to be judged."""
    if _code is not None:
        raise SystemExit(_code)
