"""What the goodput instruments cost a training step: the same CPU loop with and without them.

Instrumented = the loader wrapped in TimedIterator feeding a DataWaitMonitor (windows of 50 steps) and the
ledger's data-wait bucket, plus GoodputLedger.step_end per step (the file written every 10 s as in
production). Runs go in back-to-back pairs so drift in machine speed hits both sides; the median of the
paired differences is reported with its interquartile range.
A second loop, empty steps over prebuilt batches, shows the instruments' absolute cost per step with
nothing to hide it; divide it by a real step time for the overhead there.

    .venv/bin/python -m benchmarks.bench_goodput_overhead [--pairs 41] [--steps 50]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from resilience.goodput import DataWaitMonitor, GoodputLedger, TimedIterator

Step = Callable[[Any], None]


def mlp_step() -> Step:
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: Any) -> None:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def run(
    step: Step, make_batches: Callable[[], Iterable[Any]], steps: int, instrumented: bool, run_dir: str
) -> tuple[float, float]:
    """Wall and process-CPU seconds per step; a fresh loader each run (watch() wraps its collate_fn)."""
    batches = make_batches()
    ledger = None
    if instrumented:
        ledger = GoodputLedger(run_dir, process_start=time.time())
        ledger.startup_done()
        monitor = DataWaitMonitor(window_steps=50)
        monitor.watch(batches)
        batches = TimedIterator(batches, monitor, on_wait=ledger.data_wait)
    done = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while done < steps:
        for batch in batches:
            step(batch)
            done += 1
            if ledger is not None:
                ledger.step_end(done)
            if done == steps:
                break
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if ledger is not None:
        ledger.end()
    return elapsed / steps, cpu / steps


def measure(name: str, step: Step, make_batches: Callable[[], Iterable[Any]], steps: int, pairs: int) -> dict[str, Any]:
    """Medians over back-to-back (plain, instrumented) pairs: a pair shares the machine's momentary speed.

    CPU time of this process is reported beside wall time: the loop is CPU-bound on one thread, and CPU
    time does not count the moments other processes on a shared machine hold the cores.
    """
    plain: list[tuple[float, float]] = []
    added: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as run_dir:
        run(step, make_batches, steps, True, run_dir)  # warm-up: allocator, first-call paths
        for _ in range(pairs):
            base = run(step, make_batches, steps, False, run_dir)
            timed = run(step, make_batches, steps, True, run_dir)
            plain.append(base)
            added.append((timed[0] - base[0], timed[1] - base[1]))
    row: dict[str, Any] = {"loop": name}
    for index, clock in enumerate(("wall", "cpu")):
        quartiles = statistics.quantiles([1e6 * a[index] for a in added], n=4)
        row[clock] = (1e6 * statistics.median(p[index] for p in plain), quartiles[1], quartiles[0], quartiles[2])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=41)
    parser.add_argument("--steps", type=int, default=50, help="steps per run of the MLP loop")
    args = parser.parse_args()
    logging.getLogger("resilience.goodput").setLevel(logging.ERROR)  # the starvation warning is expected here
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(2048, 128), torch.randint(0, 10, (2048,)))
    prebuilt = list(DataLoader(data, batch_size=32))
    rows = [
        measure(
            "MLP 128-256-10 + AdamW, DataLoader batch 32",
            mlp_step(),
            lambda: DataLoader(data, batch_size=32, shuffle=True),
            args.steps,
            args.pairs,
        ),
        measure("empty step, prebuilt batches", lambda batch: None, lambda: prebuilt, 1000, args.pairs),
    ]
    print(f"torch {torch.__version__}, 1 thread; {args.pairs} back-to-back pairs of runs; medians, IQR in brackets\n")
    print("| loop | clock | plain µs/step | added µs/step | overhead |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        for clock in ("wall", "cpu"):
            base, mid, low, high = r[clock]
            share = f"{100 * mid / base:+.2f}% [{100 * low / base:+.2f}%, {100 * high / base:+.2f}%]"
            print(
                f"| {r['loop']} | {clock} | {base:.2f} | {mid:+.2f} [{low:+.2f}, {high:+.2f}] | "
                f"{share if base >= 100 else '-'} |"
            )
    cost, step = rows[1]["cpu"][1], rows[0]["cpu"][0]
    print(f"\nThe instruments alone cost {cost:.2f} µs of CPU per step: {100 * cost / step:.3f}% of this MLP step.")


if __name__ == "__main__":
    main()
