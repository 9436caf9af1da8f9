"""Deterministic incarnations of a training run for the goodput tests: a fake clock, exact step times."""

from __future__ import annotations

from pathlib import Path

from resilience.goodput import GoodputLedger


class FakeClock:
    """Monotonic and Unix clocks that move only when a test says so."""

    def __init__(self, wall_start: float) -> None:
        self.now = 0.0
        self.wall_start = wall_start

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_start + self.now

    def ledger(self, run_dir: Path, **kw: object) -> GoodputLedger:
        return GoodputLedger(run_dir, clock=self, wall=self.wall, process_start=self.wall(), **kw)  # type: ignore[arg-type]


def incarnation(
    run_dir: Path,
    wall_start: float,
    *,
    restore: int | None,
    steps: int,
    step_s: float = 1.0,
    wait_s: float = 0.0,
    startup_s: float = 10.0,
    restore_s: float = 5.0,
    save_every: int = 0,
    stall_s: float = 2.0,
    end: str | None = "completed",
    span_s: float = 10.0,
    restore_parts: dict[str, float] | None = None,
) -> float:
    """One process lifetime: startup, optional restore (``restore_parts`` its record's parts), ``steps`` steps,
    then ``end`` (None: killed).

    Returns the Unix time it stopped.
    """
    clock = FakeClock(wall_start)
    ledger = clock.ledger(run_dir, span_s=span_s)
    clock.now += startup_s
    step = 0
    if restore is not None:
        clock.now += restore_s
        ledger.restored(restore if restore > 0 else None, restore_s, restore_parts)
        step = restore
    ledger.startup_done()
    for _ in range(steps):
        clock.now += wait_s
        ledger.data_wait(wait_s)
        clock.now += step_s
        step += 1
        ledger.step_end(step)
        if save_every and step % save_every == 0:
            clock.now += stall_s
            ledger.checkpoint_stall(stall_s, step)
    if end is None:
        ledger.flush()  # what a kill leaves behind: everything up to the last boundary
    else:
        ledger.end(end)
    return clock.wall()
