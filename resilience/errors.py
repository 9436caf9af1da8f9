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
