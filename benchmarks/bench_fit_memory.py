"""Peak host memory of a whole fit, each variant in a fresh process, by proportional set size (PSS).

``bench_lightning --mode added`` and ``bench_accelerate --mode added`` sample memory cheaply (resident sizes, see
``host_memory.py``) while they time many fits in one process. Two things make those figures unfit to compare ways
of saving: a fit's peak depends on the memory earlier fits left in the process (the no-save fit's peak moves by
gigabytes from round to round), and resident sizes count a page shared by two processes once per process or not
at all, depending on who maps it. Here each variant runs one fit in a fresh process (the same fit as the
``added`` modes: ``bench_lightning.added_fit``, ``bench_accelerate.added_run``), and every 0.2 s the memory of the
training process and of every process it started is read from ``/proc/<pid>/smaps``. Private and copy-on-write
pages count by the kernel's proportional set size (PSS): each page once, split among the processes that map it.
Shared-memory segments (staging buffers: ours, DCP's stager's) count once each, by inode, at the largest resident
size any process maps of them, not by PSS: the processes are read one after another, and a segment mapped or
dropped in between (a helper that maps a save's buffers, then ends) would count up to twice by PSS. Reading
``smaps`` walks every page table (about 25 ms per GB resident), which is why the timed benchmarks do not.

The report gives each variant's peak sum, what it adds to the fit without saves, and where that peak's memory
was: shared-memory segments, the training process's other memory, and every other process's (the helper processes of
ours, DCP's checkpoint process, the resource tracker).

``--processes 2`` runs each fit as one job of 2 ranks (DDP on CPU, Accelerate's loop, started by torchrun), each
holding the whole state, as ranks on one node do; the job's processes, launcher included, are sampled from outside.

    .venv/bin/python -m benchmarks.bench_fit_memory [--frameworks lightning accelerate] [--size-gb 1.6]
        [--variants ours-async ours-sync dcp-process floor] [--steps 16] [--every 4] [--repeats 1] [--processes 1]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import ROOT, Report, emit, parse, parser, run_worker, scratch, width_for, worker_env

GIB = 2**30
SHARED_PATHS = ("/dev/shm/", "/memfd:", "/dev/zero", "/SYSV")  # tmpfs and shared anonymous mappings
DEFAULT_VARIANTS = ["ours-async", "ours-sync", "dcp-process", "floor"]


def memory(pid: int, segments: dict[tuple[str, str], int]) -> int:
    """Bytes of process ``pid`` by PSS, shared-memory segments left out; each segment's resident bytes in this
    process go into ``segments`` (by device and inode), where the largest reading is kept.

    The kernel lists mappings in address order, a page of text at a time: a mapping made, grown or merged while
    the file is read (a save maps buffers, malloc grows an arena) can be listed again after the page break, with
    its range starting below the end of the one before. Such a repeat is skipped: counted, it made a single
    reading of the training process up to 0.9 GB too high at 1.6 GB."""
    total, kind, end = 0, "", 0
    with open(f"/proc/{pid}/smaps") as lines:
        for line in lines:
            fields = line.split()
            if fields and not fields[0].endswith(":"):  # a mapping's header: range perms offset dev inode path
                start, stop = (int(bound, 16) for bound in fields[0].split("-"))
                path = fields[5] if len(fields) > 5 else ""
                kind = (
                    "repeat" if start < end else "shared" if "s" in fields[1] and path.startswith(SHARED_PATHS) else ""
                )
                key, end = (fields[3], fields[4]), max(end, stop)
            elif fields[0] == "Rss:" and kind == "shared":
                segments[key] = max(segments.get(key, 0), int(fields[1]) * 1024)
            elif fields[0] == "Pss:" and not kind:
                total += int(fields[1]) * 1024
    return total


def role(process: psutil.Process) -> str:
    """What a process of the run is, from its command line (a training process runs this module's worker)."""
    command = " ".join(process.cmdline())
    if "resource_tracker" in command:
        return "resource tracker"
    if "resilience.persist" in command:
        return "ours: fork server or helper"
    if "spawn_main" in command:
        return "DCP's checkpoint process"
    if "torch.distributed.run" in command:  # before the ranks: its command line holds theirs
        return "launcher"
    if "--worker" in command:
        return "training"
    return "other"


class ProportionalPeak:
    """While entered, sums the memory of process ``pid`` (default: this one) and its descendants every
    ``interval_s`` (:func:`memory`) and keeps the highest sum with its split."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.2) -> None:
        self._process = psutil.Process(pid)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-pss", daemon=True)
        self.peak: dict[str, Any] = {"total": 0}

    def read(self) -> dict[str, Any]:
        """One sample: the total, the shared-memory segments', the training processes' other memory, and each
        other role's."""
        segments: dict[tuple[str, str], int] = {}
        sample: dict[str, Any] = {"training": 0, "others": {}}
        for process in [self._process, *self._process.children(recursive=True)]:
            try:
                own, name = memory(process.pid, segments), role(process)
            except (OSError, psutil.Error):  # ended between the listing and the read
                continue
            if name == "training":
                sample["training"] += own
            else:
                sample["others"][name] = sample["others"].get(name, 0) + own
        sample["shared"] = sum(segments.values())
        sample["total"] = sample["training"] + sample["shared"] + sum(sample["others"].values())
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            sample = self.read()
            if sample["total"] > self.peak["total"]:
                self.peak = sample

    def __enter__(self) -> ProportionalPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def worker(framework: str, variant: str, args: argparse.Namespace) -> None:
    """One fit of ``variant`` in this fresh process; emits its peak PSS sample. One rank of several (``--processes``,
    Accelerate): the loop alone, each rank ``--steps`` steps, sampled from the benchmark's process."""
    if framework == "lightning":
        from benchmarks import bench_lightning as lightning

        model, fit, steps = lightning.Net(width_for(args.size_gb)), lightning.added_fit, args.steps
        key = lightning.NO_SAVES if variant == "no-saves" else lightning.ADDED_KEYS[variant]
    else:
        from benchmarks import bench_accelerate as accelerate
        from benchmarks.common import LAYERS, build

        model, fit = build(LAYERS, width_for(args.size_gb))[0], accelerate.added_run
        steps = args.steps * args.processes  # the loader deals its batches out to the ranks
        key = accelerate.NO_SAVES if variant == "no-saves" else accelerate.ADDED_KEYS[variant]
    from benchmarks.dcp_recipe import end_checkpoint_process

    if args.processes > 1:
        fit(model, key, Path(args.dir), steps, args.every)
        end_checkpoint_process()
        return
    with ProportionalPeak() as peak:
        fit(model, key, Path(tempfile.mkdtemp(prefix="fit-memory-", dir=args.dir)), steps, args.every)
    end_checkpoint_process()
    emit(peak.peak)


def run(framework: str, variant: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    options = [*("--size-gb", str(args.size_gb), "--steps", str(args.steps), "--every", str(args.every))]
    options += ["--threads", str(args.threads), "--processes", str(args.processes)]
    if args.processes > 1:
        return launched(["--worker", framework, variant, *options], args.processes, directory)
    (result,), _ = run_worker(
        "benchmarks.bench_fit_memory", ["--worker", framework, variant, *options, "--dir", str(directory)], timeout=900
    )
    return result


def launched(worker_args: list[str], processes: int, directory: Path) -> dict[str, Any]:
    """The peak of one job of ``processes`` ranks on this node, started by torchrun and sampled from here: the
    launcher, the ranks and every process under them. The job writes into a folder of its own, removed after."""
    run_dir = Path(tempfile.mkdtemp(prefix="job-", dir=directory))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    command += ["-m", "benchmarks.bench_fit_memory", *worker_args, "--dir", str(run_dir)]
    try:
        with (
            subprocess.Popen(
                command, cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            ) as job,
            ProportionalPeak(job.pid) as peak,
        ):
            output, _ = job.communicate(timeout=900)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if job.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {job.returncode}:\n{output[-6000:]}")
    return peak.peak


def table(report: Report, framework: str, peaks: dict[str, list[dict[str, Any]]]) -> None:
    """One row per variant: medians over the rounds of the peak and of its split."""

    def median(variant: str, pick: Any) -> float:
        return statistics.median(pick(sample) for sample in peaks[variant]) / GIB

    base = median("no-saves", lambda s: s["total"])
    roles = sorted({name for samples in peaks.values() for s in samples for name in s["others"]})
    rows = []
    for variant in peaks:
        total = median(variant, lambda s: s["total"])
        row = [variant, f"{total:.3f}", "-" if variant == "no-saves" else f"{total - base:+.3f}"]
        row += [f"{median(variant, lambda s, f=f: s[f]):.3f}" for f in ("shared", "training")]
        row += [f"{median(variant, lambda s, r=r: s['others'].get(r, 0)):.3f}" for r in roles]
        rows.append(row)
    report.add(f"**{framework}**")
    report.table(
        [
            "variant",
            "peak, all processes",
            "added by saving",
            "shared-memory segments",
            "training, other",
            *roles,
        ],
        rows,
    )


def main() -> None:
    p = parser(__doc__, size_gb=1.6, repeats=1)
    p.add_argument("--frameworks", nargs="+", choices=("lightning", "accelerate"), default=["lightning", "accelerate"])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="keys of the added modes' --variants")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--every", type=int, default=4)
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="ranks of one job on this node, DDP on CPU through torchrun, each holding the whole state and "
        "running --steps steps (Accelerate only; default %(default)s: one fresh process per fit)",
    )
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parse(p)
    if args.processes > 1 and "lightning" in args.frameworks and not args.worker:
        p.error(
            "--processes over 1 runs Accelerate's loop only (Lightning's DDP saves through rank 0 alone, "
            "which DCP's collective save cannot): add --frameworks accelerate"
        )
    if args.worker:
        worker(*args.worker, args)
        return
    report = Report(
        "Peak host memory of a whole fit, one fresh process per fit",
        f"8 x Linear(w, w) + Adam, w = {width_for(args.size_gb)} (about {args.size_gb} GB); {args.steps} steps, "
        f"a save every {args.every}; {args.processes} rank(s) on the node; {args.repeats} round(s); GiB, medians",
    )
    with scratch(args.dir, "fit-memory") as root:
        for framework in args.frameworks:
            peaks: dict[str, list[dict[str, Any]]] = {v: [] for v in ["no-saves", *args.variants]}
            for _ in range(args.repeats):
                for variant in peaks:
                    peaks[variant].append(run(framework, variant, args, root))
            table(report, framework, peaks)
    report.print()


if __name__ == "__main__":
    main()
