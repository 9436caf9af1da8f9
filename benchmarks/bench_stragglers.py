"""A straggler: a 2-rank job with rank 1 slowed 2x from the start, with and without its replacement by a spare.

Each job is a 2-rank Accelerate loop on CPU (gloo, DDP) of a small MLP under ``resilience launch``, --steps steps;
each step also sleeps --step-s after the optimizer step, standing in for accelerator time. Three variants, in
turns whose order rotates every round:

- ``healthy``: no drill; the job's wall time without a straggler.
- ``detect``: ``RESILIENCE_INJECT="slow=2.0@step=0,rank=1"``: rank 1's steps take twice as long from the start;
  the comparison names it (default settings: a window of 20 steps, two windows running, factor 1.5) and training
  goes on at its pace.
- ``replace``: the same drill with ``RESILIENCE_STRAGGLER_REPLACE=1``: the named rank is ended, rank 0 saves and
  restarts in place, and a warm spare takes rank 1 (the drill does not fire again in the restarted run).

Measured: the step at which the straggler is named and the time from the first step to it (time to detect); from
then to the first step done by the next generation (time to replace); goodput = the healthy run's time from its
first step to its last over the variant's (start-up, the same for all, is left out: on a loaded 2-core machine it
swings by seconds), and the ledger's own goodput (``resilience report``, start-up included). Also the
comparison's cost: the median time of one all-gather of its four numbers on a gloo group of the 2 ranks (once
per window).

    .venv/bin/python -m benchmarks.bench_stragglers [--steps 400] [--step-s 0.05] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Report, Stats, parser, rotated, scratch, worker_env
from resilience.goodput.summary import summarize

HEALTHY, DETECT, REPLACE = "healthy", "detect", "replace"
VARIANTS = (HEALTHY, DETECT, REPLACE)
STEPS_FILE = "steps.jsonl"
DRILL = "slow=2.0@step=0,rank=1"


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch: train --steps steps, rank 0 appending each step's end to steps.jsonl."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_resilience import attach

    root = Path(args.dir)
    accelerator = Accelerator(cpu=True)
    if args.measure_gather:
        _measure_gather(root, accelerator.process_index)
        return
    torch.manual_seed(0)
    batch = 16
    data = TensorDataset(torch.randn(args.steps * batch * 2, 64), torch.randn(args.steps * batch * 2, 1))
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=batch))
    resilience = attach(accelerator)
    point = accelerator.load_state()
    generation = int(os.environ.get("RESILIENCE_GENERATION", "0"))
    for x, y in accelerator.skip_first_batches(loader, point.batches_to_skip):
        if resilience.should_stop() or resilience.global_step >= args.steps:
            break
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_s)
        if accelerator.process_index == 0:
            with (root / STEPS_FILE).open("a") as sink:
                sink.write(json.dumps({"t": time.time(), "step": resilience.global_step + 1, "gen": generation}) + "\n")
    accelerator.end_training()
    if dist.is_initialized():
        dist.barrier()


def _measure_gather(root: Path, rank: int) -> None:
    """The comparison's collective alone: all-gather of four numbers on a gloo group, 200 times."""
    import torch.distributed as dist

    from resilience.dist import Channel

    channel = Channel(dist.new_group(backend="gloo"), "probe")
    seconds = []
    for _ in range(200):
        channel.barrier()
        start = time.perf_counter()
        channel.all_gather((0.1, 0.01, 0.02, 20))
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        (root / "gather.json").write_text(json.dumps(seconds))


def launch(variant: str, directory: Path, args: argparse.Namespace, *extra: str) -> float:
    """``resilience launch`` of 2 ranks of this script's worker for ``variant``; its wall time."""
    env = {k: v for k, v in worker_env().items() if not k.startswith(("ACCELERATE_", "RESILIENCE_"))}
    env.update(
        ACCELERATE_RESILIENCE_LOCAL_ROOT=str(directory / "ckpt"),
        ACCELERATE_RESILIENCE_HEALTH="1",
        ACCELERATE_RESILIENCE_EVERY_N_STEPS="auto",
        HF_HOME=str(directory / "hf-home"),
    )
    if variant != HEALTHY:
        env["RESILIENCE_INJECT"] = DRILL
    if variant == REPLACE:
        env["RESILIENCE_STRAGGLER_REPLACE"] = "1"
    command = [sys.executable, "-m", "resilience.cli", "launch", "--nproc-per-node=2", str(Path(__file__).resolve())]
    command += ["--worker", "--dir", str(directory), "--steps", str(args.steps), "--step-s", str(args.step_s)]
    start = time.time()
    proc = subprocess.run([*command, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return time.time() - start


def run(variant: str, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One launch of ``variant``; its wall time, detection and replacement times, and the ledger's goodput."""
    wall = launch(variant, directory, args)
    steps = [json.loads(line) for line in (directory / STEPS_FILE).read_text().splitlines()]
    summary = summarize(directory / "ckpt")
    events = [e for inc in summary.incarnations for e in inc.events]
    named = next((e for e in events if e["e"] == "straggler"), None)
    train = steps[-1]["t"] - steps[0]["t"]
    result: dict[str, Any] = {"wall_s": wall, "train_s": train, "ledger_goodput": summary.goodput_pct / 100}
    if named is not None:
        first = steps[0]["t"]
        result.update(named_step=named["step"], detect_s=named["t"] - first, ratio=named["ratio"])
        later = [s["t"] for s in steps if s["gen"] > 0]
        if later:
            result["replace_s"] = later[0] - named["t"]
    return result


def main() -> None:
    p = parser(__doc__, size_gb=None, repeats=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure-gather", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    report = Report(  # made first: it notes the machine's load at the start
        "Stragglers: detection and replacement",
        f"2 ranks, Accelerate on CPU (gloo, DDP), {args.steps} steps of a small MLP + {args.step_s} s of sleep, "
        f"drill {DRILL}, {args.repeats} rounds",
    )
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    gathers: list[float] = []
    with scratch(args.dir, "stragglers") as root:
        (root / "probe").mkdir()
        launch(HEALTHY, root / "probe", args, "--measure-gather")  # also the warm-up (imports, page cache)
        gathers = json.loads((root / "probe" / "gather.json").read_text())
        for turn in range(args.repeats):
            for variant in rotated(VARIANTS, turn):
                directory = root / f"{variant}-{turn}"
                directory.mkdir()
                results[variant].append(run(variant, directory, args))
                print(variant, turn, results[variant][-1], file=sys.stderr, flush=True)
    _report(report, results, gathers)


def _report(report: Report, results: dict[str, list[dict[str, Any]]], gathers: list[float]) -> None:
    healthy = statistics.median(r["train_s"] for r in results[HEALTHY])

    def stat(variant: str, key: str) -> str:
        values = [r[key] for r in results[variant] if key in r]
        return Stats.of(values).fmt(2) if values else "-"

    rows = []
    for variant in VARIANTS:
        goodput = Stats.of(healthy / r["train_s"] for r in results[variant]).fmt(2)
        rows.append(
            [
                variant,
                stat(variant, "wall_s"),
                stat(variant, "train_s"),
                stat(variant, "named_step"),
                stat(variant, "detect_s"),
                stat(variant, "replace_s"),
                goodput,
                stat(variant, "ledger_goodput"),
            ]
        )
    heads = ["variant", "wall", "first to last step", "named at step", "detect", "replace", "goodput", "ledger goodput"]
    report.table(heads, rows)
    if gathers:
        report.add(f"The comparison's all-gather: median {1e3 * statistics.median(gathers):.2f} ms over 200 calls.")
    report.print()


if __name__ == "__main__":
    main()
