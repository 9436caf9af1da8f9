"""How long a save stops training: ``accelerator.save_state`` next to the resilience handle, same state, one run.

The state is a model of ``--layers`` x Linear(width, width) with Adam's moments materialized (default 8 x 4096:
about 1.6 GB of parameters plus optimizer state), in a single CPU process. Three saves take turns, in an order
that rotates each turn: Accelerate's, and the handle's with synchronous and with asynchronous staging. Blocking =
until the call returns; host copy done = until the state may change again; committed = until the checkpoint is
complete on disk. The first turn is reported apart: the engine allocates its reused host buffers then.

    .venv/bin/python -m benchmarks.bench_accelerate [--layers 8] [--width 4096] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import accelerate
import psutil
import torch
from accelerate import Accelerator

from accelerate_resilience import ResilienceHandle, ResiliencePlugin, attach
from benchmarks.common import build


def accelerate_save(accelerator: Accelerator, folder: Path) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    accelerator.save_state(str(folder))
    block = time.perf_counter() - t0
    shutil.rmtree(folder)
    return block, block, block  # synchronous: returns with the files written (not synced)


def resilience_save(resilience: ResilienceHandle, step: int) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    handle = resilience.save(step=step)
    assert handle is not None
    block = time.perf_counter() - t0
    resilience.manager.wait_for_staging()
    staged = time.perf_counter() - t0
    handle.committed.result()
    return block, staged, time.perf_counter() - t0


def seconds(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5, help="timed turns after the first")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-accelerate-", dir=args.dir))
    model, optimizer, nbytes = build(args.layers, args.width)
    # Three Accelerators over the same model and optimizer (one process, no copies): Accelerate's own save,
    # and a handle each for synchronous and asynchronous staging (each keeps its own reused host buffers).
    plain = Accelerator(cpu=True)
    plain.prepare(model, optimizer)
    handles = {}
    for staging in ("sync", "async"):
        accelerator = Accelerator(cpu=True)
        accelerator.prepare(model, optimizer)
        plugin = ResiliencePlugin(local_dir=str(root / staging), keep_last=2, async_staging=staging == "async")
        handles[f"resilience save, {staging} staging"] = attach(accelerator, plugin)
    saves: dict[str, Callable[[int], tuple[float, float, float]]] = {
        "accelerator.save_state": lambda turn: accelerate_save(plain, root / f"accelerate-{turn}"),
        **{name: partial(resilience_save, handle) for name, handle in handles.items()},
    }
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in saves}
    try:
        for turn in range(args.repeats + 1):
            names = list(saves)
            for name in names[turn % len(names) :] + names[: turn % len(names)]:  # rotate who goes first
                times[name].append(saves[name](turn + 1))
    finally:
        for handle in handles.values():
            handle.close()
        shutil.rmtree(root, ignore_errors=True)

    def median(name: str, column: int) -> float:
        return statistics.median(t[column] for t in times[name][1:])

    memory = psutil.virtual_memory().total / 2**30
    print(f"### Blocking time per save, {datetime.date.today().isoformat()}\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {memory:.0f} GiB RAM, {platform.platform()}; "
        f"torch {torch.__version__}, accelerate {accelerate.__version__}. State: {args.layers} x "
        f"Linear({args.width}, {args.width}) + Adam = {nbytes / 1e9:.2f} GB, single CPU process. "
        f"Writing to {args.dir or tempfile.gettempdir()}. Median (min-max) of {args.repeats} turns in rotating "
        "order after a first turn, seconds.\n"
    )
    print("| save | blocks training | host copy done | committed | first turn: blocks / committed |")
    print("|---|---|---|---|---|")
    for name, rows in times.items():
        cells = [seconds([row[column] for row in rows[1:]]) for column in range(3)]
        print(f"| {name} | {' | '.join(cells)} | {rows[0][0]:.3f} / {rows[0][2]:.3f} |")
    baseline = median("accelerator.save_state", 0)
    print()
    for name in handles:
        print(f"{name}: blocks {baseline / median(name, 0):.1f}x less than accelerator.save_state (medians).")
    print(
        "Async staging: the host copy runs during the next forward and backward; the next optimizer step waits "
        "for it if they are shorter. Accelerate's save is complete when it returns but not synced to disk; "
        "the engine fsyncs before it commits."
    )


if __name__ == "__main__":
    main()
