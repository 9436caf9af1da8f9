"""One incarnation of a toy training loop that writes a real goodput ledger; run by tests/test_goodput_ledger.py.

Usage: goodput_worker.py RUN_DIR RESTORE_STEP STEPS [--hang] [--span-s S] [--progress]. RESTORE_STEP < 0 means a
fresh start. Prints ``reached N`` once step N is in the ledger; with ``--hang`` it then waits to be killed (like a
rank stuck in a collective after a fault). ``--span-s``: the ledger's ``span_s`` (default 0, a span per step: the
kill point is exact in the spans); ``--progress`` prints ``step N`` after each step the ledger was told of, so a
test can kill the process mid-run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from resilience.goodput import GoodputLedger

STEP_S = 0.01
WAIT_S = 0.002
RESTORE_S = 0.02


def train(ledger: GoodputLedger, restore: int, steps: int, on_step: Callable[[int], None] | None = None) -> int:
    step = 0
    if restore >= 0:
        t0 = time.perf_counter()
        time.sleep(RESTORE_S)
        ledger.restored(restore, time.perf_counter() - t0)
        step = restore
    ledger.startup_done()
    for _ in range(steps):
        t0 = time.perf_counter()
        time.sleep(WAIT_S)
        ledger.data_wait(time.perf_counter() - t0)
        time.sleep(STEP_S)
        step += 1
        ledger.step_end(step)
        if on_step is not None:
            on_step(step)
    return step


def main() -> None:
    run_dir, restore, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    span_s = float(sys.argv[sys.argv.index("--span-s") + 1]) if "--span-s" in sys.argv else 0.0
    ledger = GoodputLedger(run_dir, span_s=span_s)
    progress = (lambda step: print(f"step {step}", flush=True)) if "--progress" in sys.argv else None
    print(f"reached {train(ledger, restore, steps, progress)}", flush=True)
    if "--hang" in sys.argv:
        time.sleep(120)
    ledger.end()


if __name__ == "__main__":
    main()
