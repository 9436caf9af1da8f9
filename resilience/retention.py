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
) -> list[int]:
    """Steps whose directories can go, oldest first.

    Keeps the ``keep_last`` newest committed steps, every multiple of ``keep_every`` and everything in
    ``protected`` (still being uploaded or loaded). An uncommitted directory goes only once it is older than
    the newest commit: a newer one may be a save in flight.
    """
    if not committed:
        return []
    newest = sorted(committed, reverse=True)
    keep = set(newest[:keep_last]) | set(protected)
    if keep_every:
        keep |= {step for step in committed if step % keep_every == 0}
    doomed = {step for step in committed if step not in keep}
    doomed |= {step for step in uncommitted if step < newest[0] and step not in keep}
    return sorted(doomed)
