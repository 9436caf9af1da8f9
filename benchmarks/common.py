"""What every benchmark shares: the state under test, a training step, turns in rotating order, statistics, reports.

Each benchmark compares ours with its baselines inside one run, taking turns in an order that rotates every round,
so a machine that speeds up or slows down (other jobs, page cache, memory pressure) affects every variant alike.
Results are medians with interquartile ranges over the turns, never a single run. Heavy imports (torch, psutil)
stay inside functions so that workers timed from process start (the resume benchmark's floor) do not pay for them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GB = 1e9
ROOT = Path(__file__).resolve().parent.parent
LAYERS = 8
DEFAULT_SIZE_GB = 1.6
QUICK_SIZE_GB = 0.05
RESULT_PREFIX = "BENCH-RESULT "


# ---- the state under test ----------------------------------------------------------------------------------------


def width_for(size_gb: float, layers: int = LAYERS) -> int:
    """Width of ``layers`` x Linear(w, w) whose fp32 parameters and Adam moments come to about ``size_gb``.

    Width, not depth, follows the size, so every size has the same tensors and sizes differ in bytes alone;
    1.6 GB gives the 8 x Linear(4096, 4096) of the issues.
    """
    per_layer = size_gb * GB / layers / 12  # weight + bias, times 3: the values and Adam's two moments
    return max(64, round(math.sqrt(per_layer) / 64) * 64)


def build(layers: int, width: int, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """A model and Adam with its moments materialized; returns them and the state's size in bytes."""
    import torch

    from resilience.checkpoint.tree import tensor_bytes

    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers))).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, tensor_bytes(model_state(model, optimizer))


def model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a training script checkpoints: the model's and the optimizer's state dicts."""
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor of a nested dict/list/tuple, in order."""
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for value in tree.values() for t in tensors_in(value)]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in tensors_in(value)]
    return []


def tensor_state(total_bytes: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` fp32 tensors adding up to ``total_bytes``: to vary the tensor count with the bytes fixed."""
    import torch

    numel = max(1, total_bytes // 4 // count)
    return {f"t{i:05d}": torch.randn(numel) for i in range(count)}


class Stepper:
    """Real training steps (forward, backward, Adam) on the state being saved.

    A save that copies in the background overlaps the next forward and backward; the engine makes the next
    ``optimizer.step()`` wait for the copy (a global optimizer pre-step hook), so that wait is inside a step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, width: int, batch: int = 8):
        import torch

        self.model, self.optimizer = model, optimizer
        device = next(model.parameters()).device
        self.batch = torch.randn(batch, width, generator=torch.Generator().manual_seed(0)).to(device)
        self.cuda = device.type == "cuda"

    def step(self) -> None:
        """One step, finished when this returns (on a GPU too, so a step's time is what the device took)."""
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.batch).square().mean().backward()
        self.optimizer.step()
        if self.cuda:
            torch.cuda.synchronize()


class HostCopy:
    """The floor of any save that blocks training: one copy of each tensor into host buffers allocated once.

    Buffers for GPU tensors are pinned, as the fastest device-to-host copy needs.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def copy(self, tensors: Sequence[torch.Tensor]) -> None:
        import torch

        if len(self._buffers) != len(tensors):
            self._buffers = [torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for t in tensors]
        with torch.no_grad():
            for buffer, tensor in zip(self._buffers, tensors, strict=True):
                buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()


# ---- clocks, turns and statistics --------------------------------------------------------------------------------


def now() -> float:
    import time

    return time.perf_counter()


def rotated(names: Sequence[str], turn: int) -> list[str]:
    shift = turn % len(names)
    return [*names[shift:], *names[:shift]]


Sample = dict[str, float]


def alternate(turns: Mapping[str, Callable[[], Sample]], repeats: int, warmup: int = 1) -> dict[str, list[Sample]]:
    """Each variant's turn ``warmup + repeats`` times, in an order that rotates every round.

    Warm-up rounds are dropped: first calls allocate buffers, spawn threads and fault in pages, which a
    long-running job pays once.
    """
    samples: dict[str, list[Sample]] = {name: [] for name in turns}
    for round_ in range(warmup + repeats):
        for name in rotated(list(turns), round_):
            sample = turns[name]()
            if round_ >= warmup:
                samples[name].append(sample)
    return samples


@dataclass(frozen=True)
class Stats:
    """Median and interquartile range of repeated measurements."""

    median: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        data = sorted(values)
        if not data:
            return cls(math.nan, math.nan, math.nan, 0)
        if len(data) == 1:
            return cls(data[0], data[0], data[0], 1)
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
        return cls(statistics.median(data), q1, q3, len(data))

    def fmt(self, digits: int = 3, scale: float = 1.0) -> str:
        if self.n == 0:
            return "-"
        m, lo, hi = (scale * v for v in (self.median, self.q1, self.q3))
        return f"{m:.{digits}f}" if self.n == 1 else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def column(samples: Sequence[Sample], key: str) -> Stats:
    return Stats.of(s[key] for s in samples if key in s)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def verdict(met: bool) -> str:
    return "**met**" if met else "**not met**"


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope: how much ``y`` grows per unit of ``x``."""
    if len(set(xs)) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


# ---- process CPU time --------------------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """User + system CPU seconds so far of this process and every process it started, directly or not.

    This process: all its threads (``RUSAGE_SELF``) and its children that have exited and been waited for
    (``RUSAGE_CHILDREN``). Every live descendant (psutil, recursively): its own user + system time and that of
    its own waited-for children. So a helper process counts whether it is still running (our engine's
    ``persist="process"`` helper, forked by its fork server, a child of this process) or has exited and been
    reaped by the fork server. Take differences of two calls; a process that exits between them moves its time
    from one term to another but never out of the sum.
    """
    import resource

    import psutil

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # gone between the listing and the read: its time is in its parent's children now
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


# ---- added time per save in a real training run ------------------------------------------------------------------


# The variants' labels of the side-by-sides that run a framework's own save against ours (bench_fabric,
# bench_transformers): the no-save run every round pairs with, and ours with each staging.
NO_SAVES, OURS_ASYNC, OURS_SYNC = "no saves", "ours, async staging", "ours, sync staging"


def paired_rounds(
    names: Sequence[str], everies: Sequence[int], rounds: int, steps: int, fit: Callable[[str, int, int], Sample]
) -> dict[int, dict[str, list[Sample]]]:
    """``fit(variant, steps, every)`` for every variant (the no-save one among them) and every save interval, per
    round, after a warm-up of one short run of each variant with one save (first-run costs are no variant's).

    A round holds one fit of each variant per interval, in an order that rotates from one interval's turn to the
    next, so the fits compared with each other ran minutes apart at most. Each fit's sample holds ``wall``,
    ``cpu`` and ``saves``, and may hold ``trained`` (wall seconds until training ended, before the wait for the last
    save); ``fits[every][variant][round]`` is returned.
    """
    for name in names:
        fit(name, min(everies), min(everies))
    fits: dict[int, dict[str, list[Sample]]] = {every: {name: [] for name in names} for every in everies}
    turn = 0
    for round_ in range(rounds):
        for every in everies:
            for name in rotated(names, turn):
                sample = fit(name, steps, every)
                fits[every][name].append(sample)
                print(f"round {round_ + 1}/{rounds}, every {every}: {name}: {sample}", file=sys.stderr, flush=True)
            turn += 1
    return fits


def report_paired_rounds(
    report: Report,
    args: argparse.Namespace,
    variants: Sequence[str],
    fit: Callable[[str, Path, int, int], Sample],
    *,
    rival: str,
    ours: Sequence[str],
    no_saves: str,
    notes: Sequence[str] = (),
) -> None:
    """:func:`paired_rounds` of ``fit(variant, scratch folder, steps, every)`` over ``args.every`` and
    ``args.repeats`` rounds of ``args.steps`` steps, with the no-save run first, then :func:`report_added`."""
    with scratch(args.dir, "added") as root:
        fits = paired_rounds(
            [no_saves, *variants],
            args.every,
            args.repeats,
            args.steps,
            lambda variant, steps, every: fit(variant, root, steps, every),
        )
    kept = [variant for variant in ours if variant in variants]
    report_added(report, fits, steps=args.steps, no_saves=no_saves, floor="", rival=rival, ours=kept, notes=notes)


def added_per_save(fits: Mapping[str, Sequence[Sample]], variant: str, no_saves: str, key: str) -> Stats:
    """Median [IQR] over rounds of (the variant's fit - the same round's no-save fit) / the variant's saves."""
    pairs = zip(fits[variant], fits[no_saves], strict=True)
    return Stats.of((fit[key] - base[key]) / fit["saves"] for fit, base in pairs if fit["saves"])


def throughput_vs_no_saves(fits: Mapping[str, Sequence[Sample]], variant: str, no_saves: str, key: str) -> Stats:
    """Median [IQR] over rounds of the same round's no-save run's time over the variant's: the share of the
    no-save training rate the variant keeps (1.0: saves cost nothing)."""
    pairs = zip(fits[variant], fits[no_saves], strict=True)
    return Stats.of(base[key] / fit[key] for fit, base in pairs if fit[key] > 0)


def report_added(
    report: Report,
    fits: Mapping[int, Mapping[str, Sequence[Sample]]],
    *,
    steps: int,
    no_saves: str,
    floor: str,
    rival: str,
    ours: Sequence[str],
    notes: Sequence[str] = (),
) -> None:
    """A table per save interval of what each variant adds per save, wall and CPU, and ours against the others."""
    for every, by_variant in fits.items():
        _report_interval(report, every, by_variant, steps, no_saves, floor, rival, ours)
    report.add(
        "- Added per save = (the run's time - the same round's no-save run's) / the run's saves, per round; "
        "median [IQR] over rounds; ratios are of medians. Throughput vs no saves = the same round's no-save run's "
        "time / the run's, per round (by CPU: the same with CPU seconds). CPU = user + system seconds of the "
        "training process (all threads) and of every process it started, live or exited (our helper process included; "
        "`common.cpu_seconds`), over the same span as the wall time. A negative value: that save cost less than "
        "the noise between two runs."
    )
    for note in notes:
        report.add(f"- {note}")
    _report_fixed_and_marginal(report, fits, no_saves)


def _report_fixed_and_marginal(
    report: Report, fits: Mapping[int, Mapping[str, Sequence[Sample]]], no_saves: str
) -> None:
    """Split each variant's added time into a per-run part and a per-save part, by how it grows with the saves.

    Per interval, the median over rounds of (run - no-save run) against the saves per run; a least-squares line
    through those points: its intercept is what a run pays once (our engine's start, its helper process), its
    slope what each further save adds. Needs two intervals with different save counts.
    """
    intervals = list(fits)
    variants = [v for v in fits[intervals[0]] if v != no_saves]
    saves = {v: [Stats.of(f["saves"] for f in fits[n][v]).median for n in intervals] for v in variants}
    if not variants or any(len(set(counts)) < 2 for counts in saves.values()):
        return

    def line(variant: str, key: str) -> tuple[float, float]:
        xs = saves[variant]
        ys = [
            Stats.of(f[key] - b[key] for f, b in zip(fits[n][variant], fits[n][no_saves], strict=True)).median
            for n in intervals
        ]
        per_save = slope(xs, ys)
        return statistics.fmean(ys) - per_save * statistics.fmean(xs), per_save

    report.heading("Once per run, and per save (least-squares over the intervals)")
    rows = []
    for v in variants:
        (wall_once, wall_each), (cpu_once, cpu_each) = line(v, "wall"), line(v, "cpu")
        rows.append([v, f"{wall_once:.3f}", f"{wall_each:.3f}", f"{cpu_once:.3f}", f"{cpu_each:.3f}"])
    report.table(["variant", "wall once per run", "wall per save", "CPU once per run", "CPU per save"], rows)
    report.add(
        "- A line through each interval's median added time (run - no-save run) against its saves per run: the "
        "intercept is paid once per run (our engine's start and its helper process, a first allocation), the "
        "slope by every save. Saves closer together can also queue behind each other, which the slope holds too."
    )


def _report_interval(
    report: Report,
    every: int,
    by_variant: Mapping[str, Sequence[Sample]],
    steps: int,
    no_saves: str,
    floor: str,
    rival: str,
    ours: Sequence[str],
) -> None:
    variants = [v for v in by_variant if v != no_saves]

    def per_save(variant: str, key: str) -> Stats:
        return added_per_save(by_variant, variant, no_saves, key)

    def x_floor(variant: str, key: str) -> str:
        if floor not in variants:
            return "-"
        return f"{ratio(per_save(variant, key).median, per_save(floor, key).median):.2f}"

    saves = sorted({int(fit["saves"]) for v in variants for fit in by_variant[v]})
    report.heading(f"A save every {every} steps (saves per run of {steps} steps: {'/'.join(map(str, saves))})")
    base = {key: Stats.of(fit[key] for fit in by_variant[no_saves]) for key in ("wall", "cpu")}
    report.table(
        [
            "variant",
            "run wall",
            "added wall per save",
            "x floor",
            "throughput vs no saves",
            "run CPU",
            "added CPU per save",
            "x floor (CPU)",
            "throughput by CPU",
        ],
        [
            [no_saves, base["wall"].fmt(2), "-", "-", "-", base["cpu"].fmt(2), "-", "-", "-"],
            *(
                [
                    v,
                    Stats.of(fit["wall"] for fit in by_variant[v]).fmt(2),
                    per_save(v, "wall").fmt(),
                    x_floor(v, "wall"),
                    throughput_vs_no_saves(by_variant, v, no_saves, "wall").fmt(),
                    Stats.of(fit["cpu"] for fit in by_variant[v]).fmt(2),
                    per_save(v, "cpu").fmt(),
                    x_floor(v, "cpu"),
                    throughput_vs_no_saves(by_variant, v, no_saves, "cpu").fmt(),
                ]
                for v in variants
            ),
        ],
    )
    # "trained": seconds from the run's start to the end of its last step, before the wait for its last save
    trained = all("trained" in fit for v in by_variant for fit in by_variant[v])
    if trained:
        report.add(
            "Until the end of training (before the run's wait for its last save, which it pays once): added wall "
            "per save, and that wait."
        )
        report.table(
            ["variant", "added wall per save while training", "x floor", "the run's end: wait for its last save"],
            [
                [
                    v,
                    per_save(v, "trained").fmt(),
                    x_floor(v, "trained"),
                    Stats.of(fit["wall"] - fit["trained"] for fit in by_variant[v]).fmt(),
                ]
                for v in variants
            ],
        )
    for mine in (v for v in ours if v in variants):
        cells = []
        for key, what in (("wall", "wall"), ("cpu", "CPU")) + (
            (("trained", "wall while training"),) if trained else ()
        ):
            added = per_save(mine, key).median
            versus = f", {rival} {ratio(per_save(rival, key).median, added):.2f}x it" if rival in variants else ""
            cells.append(f"{what}: {x_floor(mine, key)}x the floor{versus}")
        report.add(f"- {mine}: " + "; ".join(cells) + ".")


# ---- host memory -------------------------------------------------------------------------------------------------


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class PeakRSS:
    """Samples this process's resident memory every few milliseconds; ``peak`` is the highest seen.

    Sampling (not the kernel's high-water mark) so that a window can be reset: each save gets its own peak.
    """

    def __init__(self, interval_s: float = 0.005):
        import psutil

        self._process = psutil.Process()
        self._interval = interval_s
        self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def reset(self) -> None:
        self.peak = self._process.memory_info().rss

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


# ---- the machine and the report ----------------------------------------------------------------------------------


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _ram_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return math.nan


def commit() -> str:
    """The checked-out commit, marked when the working tree differs from it (as while these are written)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return f"{head} + uncommitted changes" if git("status", "--porcelain") else head


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def machine() -> str:
    import torch

    return (
        f"{_cpu_model()}, {os.cpu_count()} cores, {_ram_gib():.1f} GiB RAM, Linux {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


class Report:
    """One markdown section: a heading, when and where it ran, the settings, then tables and notes."""

    def __init__(self, title: str, settings: str):
        self._load_start = loadavg()
        self._lines = [
            f"## {title}",
            "",
            f"- Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; commit {commit()}",
            f"- Machine: {machine()}",
            f"- Settings: {settings}; torch intra-op threads: {_torch_threads()}",
        ]

    def add(self, text: str = "") -> None:
        self._lines.append(text)

    def heading(self, text: str) -> None:
        self._lines += ["", f"### {text}", ""]

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
        self._lines += ["", markdown_table(headers, rows), ""]

    def print(self) -> None:
        self._lines.insert(5, f"- Load average (1, 5, 15 min) at start: {self._load_start}; at end: {loadavg()}")
        print("\n".join(self._lines).rstrip() + "\n", flush=True)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- command lines, scratch space and worker processes -----------------------------------------------------------


def parser(doc: str | None, *, size_gb: float | None = DEFAULT_SIZE_GB, repeats: int = 3) -> argparse.ArgumentParser:
    """The options every benchmark takes, with its own defaults (``size_gb=None``: the benchmark picks one)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=size_gb, help="model + Adam state, GB (default %(default)s)")
    p.add_argument("--repeats", type=int, default=repeats, help="timed rounds after a warm-up (default %(default)s)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for training (default %(default)s: on a small shared machine two threads "
        "spin against other jobs and swing step times several-fold; one leaves a core to the checkpoint "
        "pipeline, as a GPU host has spare CPU)",
    )
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line and set torch up the same way in every benchmark and worker."""
    args = p.parse_args()
    setup_torch(args.threads)
    return args


def setup_torch(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # tiny values late in a run would otherwise slow the CPU steps down


@contextmanager
def scratch(parent: str | None, prefix: str) -> Iterator[Path]:
    """A fresh directory for one benchmark's checkpoints, removed afterwards whatever happens."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def emit(result: Mapping[str, Any]) -> None:
    """Hand a worker's measurements to the benchmark that started it (one marked JSON line on stdout).

    One write call, not print's two: ranks of a job share the pipe, and a line written at once (under the
    pipe's atomic size) cannot interleave with another rank's.
    """
    sys.stdout.write(f"{RESULT_PREFIX}{json.dumps(result)}\n")
    sys.stdout.flush()


def results_in(output: str) -> list[dict[str, Any]]:
    return [json.loads(line[len(RESULT_PREFIX) :]) for line in output.splitlines() if line.startswith(RESULT_PREFIX)]


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_worker(
    module: str, args: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Run ``python -m module args`` to the end; its results and its whole output, or an error that shows it."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=worker_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} exited {proc.returncode}:\n{output[-6000:]}")
    return results_in(proc.stdout), output
