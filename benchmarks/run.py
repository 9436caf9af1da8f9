"""Run every benchmark and write one markdown report: ``make bench`` for full sizes, ``--quick`` for a smoke run.

Each benchmark runs in a process of its own, one after another, so no two models are in memory at once and no
benchmark inherits another's threads or buffers. Its markdown section (stdout) goes into the report and its
log (stderr) into ``<out dir>/logs/<name>.log``. A benchmark that fails or runs past its limit gets a section
saying so, and the others still run. Training uses one torch thread everywhere (see ``--threads`` of any
benchmark); the GPU check runs only where CUDA is available.

    .venv/bin/python -m benchmarks.run [--quick] [--only engine lightning-blocking ...] [--out FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import QUICK_SIZE_GB, ROOT, commit, loadavg, machine, width_for, worker_env

Q = str(QUICK_SIZE_GB)


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()  # added after args with --quick; a repeated option's last value wins
    takes_dir: bool = True
    timeout_s: float = 1800


BENCHES = (
    Bench("engine", "benchmarks.bench_engine", quick=("--size-gb", Q, "--repeats", "2")),
    Bench("lightning-blocking", "benchmarks.bench_lightning", ("--mode", "blocking"), ("--size-gb", Q, "--saves", "3")),
    Bench(
        "lightning-throughput",
        "benchmarks.bench_lightning",
        ("--mode", "throughput"),
        ("--size-gb", Q, "--steps", "30"),
    ),
    Bench(
        "lightning-added",
        "benchmarks.bench_lightning",
        ("--mode", "added"),
        ("--size-gb", "0.02", "--steps", "8", "--rounds", "1"),
        timeout_s=5400,
    ),
    Bench(
        "accelerate",
        "benchmarks.bench_accelerate",
        ("--repeats", "3"),
        ("--width", str(width_for(QUICK_SIZE_GB)), "--repeats", "1"),
    ),
    Bench(
        "accelerate-added",
        "benchmarks.bench_accelerate",
        ("--mode", "added"),
        ("--size-gb", "0.02", "--steps", "8", "--rounds", "1"),
        timeout_s=5400,
    ),
    Bench(
        "transformers-added",
        "benchmarks.bench_transformers",
        quick=("--size-gb", "0.02", "--steps", "8", "--rounds", "1"),
        timeout_s=5400,
    ),
    Bench("ddp", "benchmarks.bench_ddp", quick=("--size-gb", Q, "--saves", "2")),
    Bench("resume", "benchmarks.bench_resume", quick=("--size-gb", Q, "--repeats", "1")),
    Bench("memory", "benchmarks.bench_memory", quick=("--size-gb", Q, "--saves", "4")),
    Bench("fit-memory", "benchmarks.bench_fit_memory", quick=("--size-gb", "0.05", "--steps", "8")),
    Bench("s3", "benchmarks.bench_s3", quick=("--size-gb", Q, "--repeats", "1")),
    Bench(
        "health",
        "benchmarks.bench_health",
        quick=("--size-gb", Q, "--repeats", "2", "--pairs", "3", "--steps", "10", "--overhead-size-gb", "0.02"),
    ),
    Bench(
        "scaling",
        "benchmarks.bench_scaling",
        quick=(
            *("--sizes-gb", "0.01", "0.02", "0.04", "--count-gb", "0.01", "--counts", "100", "1000"),
            *("--plan-tensors", "500", "--plan-gb", "0.005", "--repeats", "1", "--rank-repeats", "1"),
        ),
    ),
    Bench("goodput", "benchmarks.bench_goodput_overhead", quick=("--pairs", "5"), takes_dir=False),
    Bench("lost-work", "benchmarks.bench_lost_work", quick=("--failures", "1", "--every", "5")),
    Bench(
        "recovery",
        "benchmarks.bench_recovery",
        quick=("--size-gb", Q, "--every", "10", "--repeats", "1", "--steps", "60", "--fail-every-s", "15"),
        timeout_s=5400,
    ),
    Bench("sharded", "benchmarks.bench_sharded", quick=("--size-gb", Q, "--saves", "2")),
)
GPU = Bench("gpu", "benchmarks.bench_gpu", quick=("--quick",), takes_dir=False, timeout_s=480)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run(bench: Bench, args: argparse.Namespace, logs: Path) -> str:
    """The benchmark's markdown section, or one that says why there is none."""
    command = [sys.executable, "-m", bench.module, *bench.args, *(bench.quick if args.quick else ())]
    if bench.takes_dir and args.dir:
        command += ["--dir", args.dir]
    print(f"[{time.strftime('%H:%M:%S')}] {bench.name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    log = logs / f"{bench.name}.log"
    start = time.monotonic()
    try:
        with log.open("w") as stderr:
            proc = subprocess.run(
                command,
                cwd=ROOT,
                env=worker_env({"OMP_NUM_THREADS": "1"}),
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                timeout=bench.timeout_s,
                check=False,
            )
    except subprocess.TimeoutExpired:
        return f"## {bench.name}\n\nNot finished: stopped after {bench.timeout_s:.0f} s (log: {log}).\n"
    elapsed = time.monotonic() - start
    print(f"[{time.strftime('%H:%M:%S')}] {bench.name}: exit {proc.returncode}, {elapsed:.0f} s", file=sys.stderr)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        return (
            f"## {bench.name}\n\nFailed (exit {proc.returncode}) after {elapsed:.0f} s; end of {log}:\n\n"
            f"```\n{tail}\n```\n"
        )
    section = proc.stdout.rstrip()
    if not section.startswith("## "):  # benchmarks that print no section heading of their own
        section = f"## {bench.name}\n\n{section}"
    return f"{section}\n\n_{elapsed:.0f} s wall for this benchmark._\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats: a smoke run")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in (*BENCHES, GPU)], help="run just these")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "results.md"))
    parser.add_argument("--dir", default=None, help="where benchmarks write checkpoints (default: temporary folders)")
    args = parser.parse_args()
    out = Path(args.out)
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    gpu = cuda_available()
    chosen = [b for b in (*BENCHES, *([GPU] if gpu else ())) if not args.only or b.name in args.only]

    load_start, start = loadavg(), time.monotonic()
    sections = [run(bench, args, logs) for bench in chosen]
    if not gpu:
        sections.append("## gpu\n\nNot run: no CUDA device on this machine (run `benchmarks/gpu_check.sh` on one).\n")
    header = [
        f"# Benchmark results{' (quick smoke run)' if args.quick else ''}",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; commit {commit()}",
        f"- Machine: {machine()}",
        f"- Load average (1, 5, 15 min) before the run: {load_start}; after: {loadavg()}",
        f"- Total: {(time.monotonic() - start) / 60:.1f} min for {len(chosen)} benchmark(s), one after another",
        f"- Command: `{' '.join(['.venv/bin/python -m benchmarks.run', *sys.argv[1:]])}`",
        "",
    ]
    out.write_text("\n".join(header) + "\n" + "\n".join(sections))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
