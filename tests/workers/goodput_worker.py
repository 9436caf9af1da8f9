"""One incarnation of a toy training loop that writes a real goodput ledger; run by tests/test_goodput_ledger.py.

Usage: goodput_worker.py RUN_DIR RESTORE_STEP STEPS [--hang]. RESTORE_STEP < 0 means a fresh start. Prints
``reached N`` once step N is in the ledger; with ``--hang`` it then waits to be killed (like a rank stuck in
a collective after a fault).
"""

from __future__ import annotations

import sys
import time

from resilience.goodput import GoodputLedger

STEP_S = 0.01
WAIT_S = 0.002
RESTORE_S = 0.02


def train(ledger: GoodputLedger, restore: int, steps: int) -> int:
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
    return step


def main() -> None:
    run_dir, restore, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ledger = GoodputLedger(run_dir, span_s=0.0)  # a span per step: the kill point is exact
    print(f"reached {train(ledger, restore, steps)}", flush=True)
    if "--hang" in sys.argv:
        time.sleep(120)
    ledger.end()


if __name__ == "__main__":
    main()
