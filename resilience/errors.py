"""Exceptions raised by the engine.

Every message names the problem and the fix; background failures carry the step, file and tier they
happened in so that the training thread can say exactly what went wrong.
"""

from __future__ import annotations


class ResilienceError(Exception):
    """Base class for all errors raised by this package."""


class ConfigError(ResilienceError, ValueError):
    """A setting cannot work (unknown URL scheme, unwritable root, ``keep_last < 2``, ...)."""


class CheckpointExistsError(ResilienceError, FileExistsError):
    """A save targets a step that is already committed; committed checkpoints are never overwritten."""


class CheckpointError(ResilienceError):
    """A save, upload or load failed; raised on the training thread with where it happened."""

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        tier: str | None = None,
        path: str | None = None,
        rank: int | None = None,
    ) -> None:
        where = [
            f"{name}={value}"
            for name, value in (("step", step), ("tier", tier), ("file", path), ("rank", rank))
            if value is not None
        ]
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.step = step
        self.tier = tier
        self.path = path
        self.rank = rank


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's manifest or files do not match: missing, truncated, altered or hostile."""


class IncompatibleStateError(CheckpointError):
    """A checkpoint is sound but does not fit what it is loaded into (other keys, other objects): a user error."""


class ReadInterruptedError(CheckpointError):
    """Another rank's read of a checkpoint was interrupted (a stop signal, Ctrl-C): says nothing of the bytes, so the
    checkpoint stays where it is and this rank stops loading too."""


class UncheckedReadError(CheckpointError):
    """A read failed in a way that is neither the storage's nor known to be the bytes': the copy is checked against
    its manifest before anything is decided about it."""


class GroupBrokenError(CheckpointError):
    """A checkpoint collective failed (a peer died, hung or left); the group is not used again."""


class NoCheckpointError(ResilienceError, FileNotFoundError):
    """No committed checkpoint that verifies was found where one was asked for."""


def describe(exc: BaseException, rank: int | None = None) -> str:
    """One line naming the root cause and the rank it happened on (DCP wraps per-rank failures)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        failed_rank, (inner, _) = next(iter(failures.items()))
        return describe(inner, failed_rank)
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"[:2000]
    return line if rank is None else f"{line} (on rank {rank})"


def causes(exc: BaseException) -> list[tuple[int | None, BaseException]]:
    """``exc`` and everything behind it, with the rank each was raised on when known: DCP hands back each rank's
    exception in a ``CheckpointException``'s ``failures``, and an error raised while another unwinds keeps that
    one as its context. A classification that looked at ``exc`` alone would miss a signal's ``SystemExit`` there."""
    found: list[tuple[int | None, BaseException]] = []
    todo: list[tuple[int | None, BaseException]] = [(None, exc)]
    seen: set[int] = set()
    while todo:
        rank, current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found.append((rank, current))
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [(r, pair[0]) for r, pair in failures.items() if isinstance(pair, tuple) and pair]
        todo += [(rank, c) for c in (current.__cause__, current.__context__) if c is not None]
    return found


def interruption(exc: BaseException) -> tuple[int | None, BaseException] | None:
    """The stop behind ``exc``, if any, and its rank: a ``SystemExit`` (a signal handler's way out), a
    ``KeyboardInterrupt``, any ``BaseException`` that is not an ``Exception``. Neither says anything of a
    checkpoint being read when it came."""
    for rank, cause in causes(exc):
        if not isinstance(cause, Exception) and getattr(cause, "failures", None) is None:
            return rank, cause
    return None
