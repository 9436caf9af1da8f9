"""Which checkpoints a tier may delete: a pure function, so the rule is easy to read and to test."""

from __future__ import annotations

from collections.abc import Collection


def steps_to_delete(
    committed: Collection[int],
    uncommitted: Collection[int],
    *,
    keep_last: int,
    keep_every: int | None,
    protected: Collection[int] = (),
    foreign: Collection[int] = (),
) -> list[int]:
    """Steps whose directories can go, oldest first.

    Keeps the ``keep_last`` newest committed steps, every multiple of ``keep_every`` and everything in
    ``protected`` (still being uploaded or loaded). An uncommitted directory goes only once it is older than
    the newest commit: a newer one may be a save in flight. Steps in ``foreign`` belong to another run (or to
    no run this one can tell): they are neither counted nor deleted, so a job sharing storage with another by
    mistake never removes the other's checkpoints, nor keeps fewer of its own because of them.
    """
    others = set(foreign)
    committed = [step for step in committed if step not in others]
    if not committed:
        return []
    newest = sorted(committed, reverse=True)
    keep = set(newest[:keep_last]) | set(protected)
    if keep_every:
        keep |= {step for step in committed if step % keep_every == 0}
    doomed = {step for step in committed if step not in keep}
    doomed |= {step for step in uncommitted if step < newest[0] and step not in keep and step not in others}
    return sorted(doomed)
