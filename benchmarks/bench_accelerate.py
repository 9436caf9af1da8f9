"""Accelerate: how long a save stops training (``--mode blocking``), and what saves add to a training loop
(``--mode added``).

--mode blocking (the default): the state is a model of ``--layers`` x Linear(width, width) with Adam's moments
materialized (default 8 x 4096: about 1.6 GB of parameters plus optimizer state), in a single CPU process. Four
saves take turns, in an order that rotates each turn: Accelerate's, the handle's with synchronous and with
asynchronous staging, and DCP's process-based ``async_save`` with a persistent ``DefaultStager`` and asynchronous
staging (``benchmarks/dcp_recipe.py``). Blocking = until the call returns; host copy done = until the state may
change again; committed = until the checkpoint is complete on disk. The first turn is reported apart: the engine
allocates its reused host buffers then, DCP's stager too, and DCP starts its process.

--mode added: a plain Accelerate training loop (``Accelerator(cpu=True)``, one process) of --steps steps (default
16) over the model of the Lightning benchmark (8 x Linear(w, w) + Adam, w from --size-gb; 1.6 GB gives w = 4096),
batch 8 of synthetic data. Every N steps (each N of --every, default 4 and 8) the loop calls
``accelerator.save_state()``, with ``ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)``:
Accelerate's own save (safetensors and ``torch.save`` files in ``checkpoints/checkpoint_<i>``), or, for ours, the
same call after ``attach(accelerator, ResiliencePlugin(...))``, which routes it to ``resilience.save()``
(asynchronous staging, the plugin's default, or synchronous; checkpoints in ``<project_dir>/resilience``), or, in
place of that call, DCP's process-based ``async_save`` with a persistent ``DefaultStager`` as a demanding user runs
it (``benchmarks/dcp_recipe.py``: ``dcp-process``, asynchronous staging, which the loop waits for before each
``optimizer.step()`` as torchtitan's does; ``dcp-process-sync``, staged within the call; ``step-<N>`` directories,
fsynced). Next to them: the floor (the same points copy every tensor into buffers allocated once, and write nothing)
and the same loop without saves. A run's wall time spans ``attach`` (ours; the others start at the same point), the
loop, and the wait until its last save is complete: ``resilience.wait()`` (committed; ``close()``, after the clock
stops, ends its helper process), the DCP recipe's last upload; Accelerate's save is complete when it returns (not
synced to disk). The same until the loop's end, before that wait (a run pays it once, however long it runs), is
reported too. Paired rounds as in ``bench_lightning --mode added``: added wall time per save = (the run's wall time
- the same round's no-save run's) / saves, and the same from CPU time: user + system seconds of the training process
(all threads) and of every process it started, live or exited, so our helper process (``persist="process"``) and
DCP's checkpoint process count; see ``common.cpu_seconds``. Medians [IQR] over --rounds rounds (default 3) after an
untimed warm-up round of one short run per variant (our helpers' fork server and DCP's process start then, and are
kept from run to run, as a training process keeps them), and the split into a once-per-run part (``attach()``: the
engine and its helper; DCP's groups and stager) and a per-save part. Also each variant's peak host memory per run,
of the training process and every process it started (``benchmarks/host_memory.py``).

    .venv/bin/python -m benchmarks.bench_accelerate [--layers 8] [--width 4096] [--repeats 5] [--dir DIR]
    .venv/bin/python -m benchmarks.bench_accelerate --mode added [--size-gb 1.6] [--steps 16] [--every 4 8]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import accelerate
import psutil
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader, TensorDataset

from accelerate_resilience import ResilienceHandle, ResiliencePlugin, attach
from benchmarks.common import (
    DEFAULT_SIZE_GB,
    LAYERS,
    HostCopy,
    Report,
    Sample,
    build,
    cpu_seconds,
    model_state,
    now,
    paired_rounds,
    report_added,
    scratch,
    setup_torch,
    tensors_in,
    width_for,
)
from benchmarks.dcp_recipe import DCP_ASYNC, DCP_KEYS, DCP_SYNC, DcpProcessSaver, end_checkpoint_process
from benchmarks.host_memory import TreeMemory, persistent_helpers, report_memory

BATCH = 8
NO_SAVES, SAVE_STATE, OURS_ASYNC, OURS_SYNC, OURS_BUFFERED, FLOOR = (
    "no saves",
    "accelerator.save_state (Accelerate's own)",
    "ours: attach(), async staging (the plugin's default)",
    "ours: attach(), sync staging",
    "ours: attach(), async staging, buffered writes (direct_io=False)",
    "floor: copy into preallocated buffers",
)
OURS = (OURS_ASYNC, OURS_SYNC, OURS_BUFFERED)
ADDED_KEYS = {
    "save-state": SAVE_STATE,
    "ours-async": OURS_ASYNC,
    "ours-sync": OURS_SYNC,
    "ours-buffered": OURS_BUFFERED,
    **DCP_KEYS,
    "floor": FLOOR,
}
ADDED_DEFAULT = [key for key in ADDED_KEYS if key != "dcp-process-sync"]


def accelerate_save(accelerator: Accelerator, folder: Path) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    accelerator.save_state(str(folder))
    block = time.perf_counter() - t0
    shutil.rmtree(folder)
    return block, block, block  # synchronous: returns with the files written (not synced)


def dcp_save(saver: DcpProcessSaver, state: dict[str, Any], folder: Path) -> tuple[float, float, float]:
    """The DCP recipe's save: blocks for the call (with asynchronous staging, the next update's wait for the copy
    comes on top: "host copy done"), committed once DCP's process has written and fsynced it."""
    t0 = time.perf_counter()
    saver.save(state, folder)
    block = time.perf_counter() - t0
    saver.wait_for_staging()
    staged = time.perf_counter() - t0
    saver.wait()
    committed = time.perf_counter() - t0
    shutil.rmtree(folder)
    return block, staged, committed


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


def added_run(model: torch.nn.Module, variant: str, root: Path, steps: int, every: int) -> Sample:
    """One training loop of ``steps`` steps saving every ``every``: wall and CPU seconds, saves made.

    Under a launcher (``WORLD_SIZE`` over 1) every rank saves into ``root`` itself, which the caller gives each
    run afresh and removes: one job's ranks write one checkpoint."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        directory = root
    else:
        directory = Path(tempfile.mkdtemp(prefix="added-", dir=root))
    width = model[0].in_features
    accelerator = Accelerator(
        cpu=True, project_config=ProjectConfiguration(project_dir=str(directory), automatic_checkpoint_naming=True)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)  # fresh moments every run, as in a new fit
    data = DataLoader(TensorDataset(torch.randn(steps * BATCH, width)), batch_size=BATCH)
    net, optimizer, data = accelerator.prepare(model, optimizer, data)
    floor = HostCopy() if variant == FLOOR else None
    gc.collect()
    owner = "ours" if variant in OURS else "dcp" if variant in (DCP_ASYNC, DCP_SYNC) else ""
    with TreeMemory(keep=persistent_helpers(owner)) as memory:
        wall, cpu = now(), cpu_seconds()
        resilience, dcp = None, None
        if variant in OURS:
            plugin = ResiliencePlugin(
                keep_last=2, async_staging=variant != OURS_SYNC, direct_io=variant != OURS_BUFFERED
            )
            resilience = attach(accelerator, plugin)
        elif variant in (DCP_ASYNC, DCP_SYNC):
            dcp = DcpProcessSaver(async_staging=variant == DCP_ASYNC)
        saves = 0
        for step, (batch,) in enumerate(data, start=1):
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(net(batch).square().mean())
            if dcp is not None:
                dcp.wait_for_staging()  # the update waits for the last save's copy, as torchtitan's loop does
            optimizer.step()
            if step % every or variant == NO_SAVES:
                continue
            saves += 1
            if floor is not None:
                floor.copy(tensors_in(model_state(model, optimizer)))
            elif dcp is not None:
                dcp.save(model_state(model, optimizer), directory / f"step-{step}")
            else:
                accelerator.save_state()  # ours once attached: resilience.save(), in the background
        trained = now() - wall
        if resilience is not None:
            resilience.wait()  # the last save committed
        if dcp is not None:
            dcp.wait()  # the last save written and fsynced
        wall, cpu = now() - wall, cpu_seconds() - cpu
    made = resilience.manager.stats.saves if resilience is not None else dcp.saves if dcp is not None else saves
    if made != saves:
        raise RuntimeError(f"{variant}: {made} saves made, {saves} asked for")
    if resilience is not None:
        resilience.close()
    if dcp is not None:
        dcp.close()  # its staging buffers and groups; DCP's process stays for the next run, as our fork server
    accelerator.free_memory()
    del accelerator, optimizer, net, data, resilience, dcp
    gc.collect()
    if directory != root:  # else the caller's, once every rank is done
        shutil.rmtree(directory, ignore_errors=True)
    return {"wall": wall, "cpu": cpu, "saves": saves, "trained": trained, **memory.sample()}


def added(args: argparse.Namespace) -> None:
    setup_torch(args.threads)
    width = width_for(args.size_gb)
    model, _, size = build(LAYERS, width)
    variants = [ADDED_KEYS[key] for key in args.variants]
    names = [NO_SAVES, *variants]
    report = Report(
        "Accelerate: added wall time per save in a training loop (issue 4)",
        f"{LAYERS} x Linear({width}, {width}) + Adam = {size / 1e9:.2f} GB, batch {BATCH}, Accelerator(cpu=True), "
        f"one process; {args.steps} steps per run, accelerator.save_state() every N steps for N in "
        f"{', '.join(map(str, args.every))}; {args.rounds} paired round(s) after a warm-up round, variants in "
        "rotating order; median [IQR] in seconds",
    )
    try:
        with scratch(args.dir, "accelerate") as root:
            fits = paired_rounds(
                names, args.every, args.rounds, args.steps, lambda v, steps, n: added_run(model, v, root, steps, n)
            )
    finally:
        end_checkpoint_process()  # DCP's, kept from run to run as a training process keeps it
    report_added(
        report,
        fits,
        steps=args.steps,
        no_saves=NO_SAVES,
        floor=FLOOR,
        rival=SAVE_STATE,
        ours=[v for v in OURS if v in variants],
        notes=[
            "A run spans `attach()` (ours; the DCP recipe's saver is made at the same point), the loop and the "
            "wait for its last save (committed, for ours; written, for DCP). Accelerate's files go to the page "
            "cache without fsync; ours fsyncs before it commits, DCP's FileSystemWriter before its save completes; "
            "the floor writes nothing."
        ],
    )
    report_memory(report, fits, NO_SAVES)
    report.print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("blocking", "added"), default="blocking")
    parser.add_argument("--layers", type=int, default=8, help="blocking: layers (default %(default)s)")
    parser.add_argument("--width", type=int, default=4096, help="blocking: layer width (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="blocking: timed turns after the first")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--size-gb", type=float, default=DEFAULT_SIZE_GB, help="added: model + Adam state, GB")
    parser.add_argument("--steps", type=int, default=16, help="added: steps per run (default %(default)s)")
    parser.add_argument("--every", type=int, nargs="+", default=[4, 8], help="added: steps between saves")
    parser.add_argument("--rounds", type=int, default=3, help="added: paired rounds after a warm-up (default 3)")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(ADDED_KEYS),
        default=ADDED_DEFAULT,
        help="added: variants besides the no-save run (default %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=1, help="added: torch intra-op threads (default 1)")
    args = parser.parse_args()
    if args.mode == "added":
        added(args)
        return

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
        plugin = ResiliencePlugin(local_root=str(root / staging), keep_last=2, async_staging=staging == "async")
        handles[f"resilience save, {staging} staging"] = attach(accelerator, plugin)
    dcp = DcpProcessSaver()  # its first turn starts DCP's process, in the background: "committed" waits for it
    saves: dict[str, Callable[[int], tuple[float, float, float]]] = {
        "accelerator.save_state": lambda turn: accelerate_save(plain, root / f"accelerate-{turn}"),
        **{name: partial(resilience_save, handle) for name, handle in handles.items()},
        DCP_ASYNC: lambda turn: dcp_save(dcp, model_state(model, optimizer), root / f"dcp-{turn}"),
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
        dcp.close()
        end_checkpoint_process()
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
    for name in [*handles, DCP_ASYNC]:
        print(f"{name}: blocks {baseline / median(name, 0):.1f}x less than accelerator.save_state (medians).")
    print(
        "Async staging: the host copy runs during the next forward and backward; the next optimizer step waits "
        "for it if they are shorter. Accelerate's save is complete when it returns but not synced to disk; "
        "the engine fsyncs before it commits, DCP's FileSystemWriter before its save completes."
    )


if __name__ == "__main__":
    main()
