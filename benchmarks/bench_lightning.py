"""Lightning: how long each CheckpointIO stops training per save, and what saving costs 100 steps (issue 3).

A LightningModule of 8 x Linear(w, w) with Adam (w from --size-gb; 1.6 GB gives w = 4096), synthetic data,
``Trainer(accelerator="cpu")`` (``--accelerator gpu``: one CUDA device, each step's input made once on it; the
floor's buffers are then pinned, so it is the pinned device-to-host copy of the state), one fit per variant per
round, variants in rotating order. Saves go through ``trainer.save_checkpoint`` from a callback on the training
thread; blocking = the wall time of that call, plus for asynchronous staging the wait it makes the next
``optimizer.step()`` do (ours: the engine's pre-step hook; the DCP recipe: ``on_before_optimizer_step``; read
from their counters). Variants (--variants, every mode): TorchCheckpointIO (Lightning's default),
AsyncCheckpointIO (clones every tensor on the training thread, then torch.save in a thread), ours
(``ResilientCheckpointIO``) with synchronous and asynchronous staging, DCP's process-based ``async_save`` with
a persistent ``DefaultStager`` (``dcp-process``; ``dcp-process-sync`` stages within the call; the recipe and why:
``benchmarks/dcp_recipe.py``; the CheckpointIO: ``benchmarks/lightning_io.py``), and the floor (a CheckpointIO
that copies every tensor into preallocated buffers and writes nothing). Every mode also reports each variant's
peak host memory per fit, of the training process and every process it started (``benchmarks/host_memory.py``).

--mode blocking: after a warm-up fit per variant with one save (throughput too), each fit saves every 2nd step and,
at the end of the step after a save, waits for that save to complete, so each save is timed on a quiet machine; the
first save of a fit (it allocates the reused buffers) is reported apart.
--mode throughput: 100 steps with a save every 10 (at steps 5, 15, ..., 95, so each save's background work falls
inside the run), next to the same fit without saves; the fit's end waits for the last save (and, for ours, its
``.ckpt`` file; a fit's files are removed after it). Besides the whole fit, the steady state a long run is made of:
the save intervals but each fit's first and last (the first save's allocation, the final wait: once per run).
--batch sets the compute per step against the same state (a GPU step does far more work per byte of state than this
CPU one).
--mode added: what a save adds to a real fit, wall time and CPU time. Each fit is ``Trainer.fit()`` of --steps steps
(default 16) with ``ModelCheckpoint(every_n_train_steps=N, save_top_k=-1)`` for each N of --every (default 4 and 8),
so a fit makes steps // N saves. A fit's wall time runs from the ``fit()`` call until it has returned and its last
save is complete: Lightning's teardown waits for AsyncCheckpointIO's thread, the DCP recipe's last upload, and our
engine's commit and ``.ckpt`` names; ``drain`` then confirms it. Paired rounds: a round holds, for each N, one fit
of every variant and one fit without saves, in an order that rotates from turn to turn; a variant's added wall time
per save in that round is (its fit's wall time - the same round's no-save fit's) / its saves; the same until
training ended (``on_train_end``, before the teardown's wait for the last save, which a fit pays once, however long
it runs), and that wait apart. The same from CPU time: user + system seconds of the training process (all threads)
and of every process it started, the helper process our engine persists in by default (``persist="process"``) and
DCP's checkpoint process included, whether still running (psutil, live descendants) or exited (``RUSAGE_CHILDREN``,
and the fork server's own reaped children); see ``common.cpu_seconds``. Medians [IQR] over --rounds rounds (default
3) after an untimed warm-up round of one short fit per variant (the helper's fork server starts, buffers are
allocated, pages are faulted in, DCP's process starts: it imports this module again; it and our fork server are kept
from fit to fit, as a training process keeps them). Our engine's per-fit start (manager, helper process) is inside
the fit and so shared out over its saves, as is the DCP recipe's (process groups, stager); a last table splits each
variant's added time into a once-per-fit part and a per-save part, by a least-squares line through the intervals'
medians against their saves per fit. With ModelCheckpoint, ours writes each checkpoint twice: the engine's committed
step, then, from it, the ``.ckpt`` file at the name Lightning asks for (after the commit: in the background at 64 MB
of tensors and more, ``sync_names_below_mb``, before ``save_checkpoint`` returns below that, so at smoke sizes ours
waits for every commit); ``--variants ... ours-periodic`` (``ours-periodic-sync``: sync staging) adds ours saving
through ``PeriodicCheckpoint``, which makes no names.

    .venv/bin/python -m benchmarks.bench_lightning --mode blocking [--size-gb 1.6] [--saves 4] [--repeats 1]
    .venv/bin/python -m benchmarks.bench_lightning --mode throughput [--size-gb 0.4] [--steps 100] [--every 10]
    .venv/bin/python -m benchmarks.bench_lightning --mode added [--size-gb 1.6] [--steps 16] [--every 4 8] [--rounds 3]
"""

from __future__ import annotations

import gc
import itertools
import logging
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import (
    LAYERS,
    Report,
    Stats,
    cpu_seconds,
    now,
    paired_rounds,
    parse,
    parser,
    ratio,
    report_added,
    rotated,
    scratch,
    verdict,
    width_for,
)
from benchmarks.dcp_recipe import DCP_ASYNC, DCP_KEYS, DCP_SYNC, end_checkpoint_process
from benchmarks.gpu_utilization import Utilization, mean_within
from benchmarks.host_memory import MEMORY_NOTE, TreeMemory, memory_table, persistent_helpers, report_memory
from benchmarks.lightning_io import (
    CountedCheckpoint,
    DcpProcessIO,
    HostCopyIO,
    TrainingEnd,
    drain,
    staging_wait,
    variant_callbacks,
)
from lightning_resilience import PeriodicCheckpoint, ResilientCheckpointIO

BATCH = 8
NO_SAVES, TORCH_IO, ASYNC_IO, SYNC, ASYNC, FLOOR = (
    "no saves",
    "TorchCheckpointIO (default)",
    "AsyncCheckpointIO",
    "ours, sync staging",
    "ours, async staging",
    "floor: copy into preallocated buffers",
)
PERIODIC = "ours, async staging, PeriodicCheckpoint (no .ckpt names)"
PERIODIC_SYNC = "ours, sync staging, PeriodicCheckpoint (no .ckpt names)"
BUFFERED = "ours, async staging, buffered writes (direct_io=False)"


class Net(pl.LightningModule):
    """8 x Linear(w, w) trained with Adam on a mean-square loss: the state is parameters plus Adam's moments.

    ``accelerator`` is the Trainer's the benchmark fits it with; on "gpu" every step trains on one input made
    once on the device, so a step is compute alone (a host batch of 16384 x 4096 would add a 268 MB
    host-to-device copy to every step).
    """

    def __init__(self, width: int, layers: int = LAYERS, batch: int = BATCH, accelerator: str = "cpu") -> None:
        super().__init__()
        self.width, self.batch = width, batch  # batch: the rows of each step's data (the compute per step)
        self.accelerator = accelerator
        self._input: torch.Tensor | None = None
        self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))

    @property
    def device_data(self) -> bool:
        """Each step's input is made once on the device, not loaded."""
        return self.accelerator == "gpu"

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if not self.device_data:
            return self.net(batch[0]).square().mean()
        if self._input is None or self._input.device != self.device:
            self._input = torch.randn(self.batch, self.width, device=self.device)
        return self.net(self._input).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def loader(model: Net, steps: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    if model.device_data:  # the steps' input is on the device already: the loader only counts the steps
        return DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)
    return DataLoader(TensorDataset(torch.randn(steps * model.batch, model.width)), batch_size=model.batch)


def trainer(max_steps: int, root: Path, accelerator: str = "cpu", **kwargs: Any) -> pl.Trainer:
    """A one-device Trainer with nothing on that a benchmark does not ask for (no logger, progress bar or
    checkpoints)."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return pl.Trainer(
        accelerator=accelerator,
        max_steps=max_steps,
        logger=False,
        # Lightning wants this on when a Checkpoint callback (AutoResume) is given, and adds none of its own then
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in kwargs.get("callbacks") or ()),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


PLUGINS: dict[str, Callable[[Path], CheckpointIO | None]] = {
    NO_SAVES: lambda root: None,
    TORCH_IO: lambda root: None,
    ASYNC_IO: lambda root: AsyncCheckpointIO(),
    SYNC: lambda root: ResilientCheckpointIO(str(root / "ours"), keep_last=2),
    ASYNC: lambda root: ResilientCheckpointIO(str(root / "ours"), keep_last=2, async_staging=True),
    FLOOR: lambda root: HostCopyIO(),
    PERIODIC: lambda root: ResilientCheckpointIO(str(root / "ours"), keep_last=2, async_staging=True),
    PERIODIC_SYNC: lambda root: ResilientCheckpointIO(str(root / "ours"), keep_last=2),
    BUFFERED: lambda root: ResilientCheckpointIO(str(root / "ours"), keep_last=2, async_staging=True, direct_io=False),
    DCP_ASYNC: lambda root: DcpProcessIO(),
    DCP_SYNC: lambda root: DcpProcessIO(async_staging=False),
}
ADDED_KEYS = {
    "torch": TORCH_IO,
    "async-io": ASYNC_IO,
    "ours-sync": SYNC,
    "ours-async": ASYNC,
    "floor": FLOOR,
    "ours-periodic": PERIODIC,
    "ours-periodic-sync": PERIODIC_SYNC,
    "ours-buffered": BUFFERED,
    **DCP_KEYS,
}
ADDED_DEFAULT = ("torch", "async-io", "ours-sync", "ours-async", "dcp-process", "floor")


class TimedSaves(pl.Callback):
    """Saves at the given global steps and records what each save costs the training thread.

    With ``drain``, the step after a save ends by waiting for that save to complete (not counted), and the
    file is removed as ModelCheckpoint's top-k would, so every save is timed without the previous one's
    background work. ``marks`` holds the time at the end of every step, for throughput over windows.
    """

    def __init__(self, root: Path, steps: set[int], drain: bool) -> None:
        self.root, self.steps, self.drain = root, steps, drain
        self.blocks: list[dict[str, float]] = []
        self.marks: list[float] = []
        self.memory: dict[str, float] = {}  # the fit's peak host memory (host_memory.TreeMemory)
        self.utilization: list[tuple[float, int]] = []  # on a GPU: (time, percent) readings (gpu_utilization)
        self._pending: tuple[str, float] | None = None  # path, staging-wait counter at the save

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start, self.cpu_start = now(), cpu_seconds()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        io = trainer.strategy.checkpoint_io
        if self._pending is not None:
            path, waited = self._pending
            self.blocks[-1]["wait"] = staging_wait(io) - waited
            self.blocks[-1]["block"] += self.blocks[-1]["wait"]
            self._pending = None
            if self.drain:
                drain(io)
                trainer.strategy.remove_checkpoint(path)
        if trainer.global_step in self.steps:
            path = str(self.root / f"step={trainer.global_step}.ckpt")
            start = now()
            trainer.save_checkpoint(path)
            self.blocks.append({"block": now() - start, "wait": 0.0})
            self._pending = (path, staging_wait(io))
        self.marks.append(now())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        drain(trainer.strategy.checkpoint_io)
        self.end, self.cpu_end = now(), cpu_seconds()


def fit(model: Net, variant: str, root: Path, steps: int, save_at: set[int], drain_each: bool) -> TimedSaves:
    """One Trainer.fit of ``steps`` steps with ``variant``'s CheckpointIO; fresh Adam state, same model. Its
    checkpoints are removed afterwards (at 1.6 GB, a fit's dozen kept saves would fill a disk over the rounds)."""
    directory = Path(tempfile.mkdtemp(prefix="fit-", dir=root))
    io = PLUGINS[variant](directory)
    saves = TimedSaves(directory, set() if variant == NO_SAVES else save_at, drain_each)
    callbacks = [saves, *variant_callbacks(io)]
    run = trainer(steps, directory, model.accelerator, plugins=[io] if io is not None else None, callbacks=callbacks)
    with TreeMemory(keep=helpers(variant)) as memory, Utilization(model.accelerator == "gpu") as busy:
        run.fit(model, loader(model, steps))
    saves.memory, saves.utilization = memory.sample(), busy.readings
    if isinstance(io, DcpProcessIO):
        io.close()  # frees its buffers and groups (after the fit: not timed, as our engine's close)
    del run, io
    gc.collect()
    shutil.rmtree(directory, ignore_errors=True)
    return saves


def helpers(variant: str) -> set[int]:
    """The helpers outliving a fit that ``variant``'s fits count in their host memory (ours: the fork server)."""
    ours, dcp = variant in (SYNC, ASYNC, PERIODIC, PERIODIC_SYNC, BUFFERED), variant in (DCP_ASYNC, DCP_SYNC)
    return persistent_helpers("ours" if ours else "dcp" if dcp else "")


def blocking(args: Any, model: Net, root: Path, report: Report) -> None:
    variants = [ADDED_KEYS[key] for key in args.variants]
    for variant in variants:  # warm-up, a save each: first-fit costs (helper processes' starts) are no variant's
        fit(model, variant, root, 3, {2}, drain_each=True)
    first: dict[str, list[float]] = {v: [] for v in variants}
    later: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    memory: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    save_at = {2 * i for i in range(1, args.saves + 1)}
    for round_ in range(args.repeats):
        for variant in rotated(variants, round_):
            saves = fit(model, variant, root, 2 * args.saves + 1, save_at, drain_each=True)
            first[variant].append(saves.blocks[0]["block"])
            later[variant] += saves.blocks[1:]
            memory[variant].append(saves.memory)

    def block(variant: str) -> Stats:
        return Stats.of(b["block"] for b in later.get(variant, ()))

    def versus(a: float, b: float, form: str, of: str) -> str:  # a / b, "-" if the variant ``of`` did not run
        return form.format(ratio(a, b)) if of in variants else "-"

    floor, async_io = block(FLOOR).median, block(ASYNC_IO).median
    report.table(
        [
            "CheckpointIO",
            "first save",
            "blocking per save",
            "of which staging wait",
            "x floor",
            "AsyncCheckpointIO / it",
        ],
        [
            [
                v,
                Stats.of(first[v]).fmt(),
                block(v).fmt(),
                Stats.of(b["wait"] for b in later[v]).fmt(),
                versus(block(v).median, floor, "{:.2f}", FLOOR),
                versus(async_io, block(v).median, "{:.1f}x", ASYNC_IO),
            ]
            for v in variants
        ],
    )
    for v in (v for v in (ASYNC, SYNC) if ASYNC_IO in variants and v in variants):
        less = ratio(async_io, block(v).median)
        report.add(
            f"- Target: at least 20x less blocking than AsyncCheckpointIO, {v}: {less:.1f}x, {verdict(less >= 20)}."
        )
    report.add(
        "- AsyncCheckpointIO blocks for a clone of every tensor into fresh memory on the training thread; "
        "TorchCheckpointIO for the whole torch.save (to the page cache, no fsync); the DCP recipe for the wait for "
        "the previous save's upload (none here: each is waited for) and the staging copy, or with asynchronous "
        "staging the wait for it before the next update (a fit's first save also makes its process groups and "
        "stager)."
    )
    memory_table(report, memory)
    report.add(f"- {MEMORY_NOTE}")


def throughput(args: Any, model: Net, root: Path, report: Report) -> None:
    save_at = set(range(args.every // 2, args.steps + 1, args.every))
    variants = [NO_SAVES, *(ADDED_KEYS[key] for key in args.variants)]
    runs: dict[str, list[TimedSaves]] = {v: [] for v in variants}
    for variant in variants:  # warm-up, a save each: first-fit costs (helper processes' starts) are no variant's
        fit(model, variant, root, args.every, {args.every // 2}, drain_each=False)
    for round_ in range(args.repeats):
        for variant in rotated(variants, round_):
            runs[variant].append(fit(model, variant, root, args.steps, save_at, drain_each=False))

    def rate(variant: str) -> Stats:
        return Stats.of(args.steps / (r.end - r.start) for r in runs[variant])

    def cpu(variant: str) -> Stats:
        return Stats.of((r.cpu_end - r.cpu_start) / args.steps for r in runs[variant])

    def spans(variant: str) -> list[list[float]]:
        """Each run's seconds per ``every`` steps, each window holding one save (the last one includes the final
        wait)."""
        out = []
        for r in runs[variant]:
            bounds = [r.start, *r.marks[args.every - 1 :: args.every]]
            bounds[-1] = r.end
            out.append([b - a for a, b in itertools.pairwise(bounds)])
        return out

    def windows(variant: str) -> Stats:
        return Stats.of(span for run in spans(variant) for span in run)

    def steady(variant: str) -> Stats:
        """The windows a long run is made of: not the first (its save allocates the reused buffers, and the
        first steps warm up) nor the last (the wait for the last save), which a run pays once."""
        return Stats.of(span for run in spans(variant) for span in run[1:-1])

    def busy(variant: str) -> str:
        """On a GPU: per round, the mean utilization in the steady windows, percent."""
        means = []
        for r in runs[variant]:
            bounds = [r.start, *r.marks[args.every - 1 :: args.every]]
            means.append(mean_within(r.utilization, [(bounds[1], bounds[-2])] if len(bounds) > 3 else []))
        return Stats.of(m for m in means if m is not None).fmt(1)

    def steady_share(variant: str) -> Stats:
        """Per round, the no-save fit's median steady window over the variant's: paired, as the rounds ran
        minutes apart and the machine's speed moves between them."""
        pairs = zip(spans(NO_SAVES), spans(variant), strict=True)
        return Stats.of(ratio(statistics.median(base[1:-1]), statistics.median(run[1:-1])) for base, run in pairs)

    base, base_cpu = rate(NO_SAVES).median, cpu(NO_SAVES).median
    report.table(
        [
            "CheckpointIO",
            "steps/s",
            "x no saves",
            f"seconds per {args.every} steps",
            "steady windows",
            "x no saves (steady)",
            "blocking per save",
            "CPU s/step",
            "x no saves (CPU)",
            "GPU busy, steady, %",
        ],
        [
            [
                v,
                rate(v).fmt(3),
                f"{ratio(rate(v).median, base):.3f}",
                windows(v).fmt(),
                steady(v).fmt(),
                steady_share(v).fmt(),
                Stats.of(b["block"] for r in runs[v] for b in r.blocks).fmt(),
                cpu(v).fmt(3),
                f"{ratio(base_cpu, cpu(v).median):.3f}",
                busy(v),
            ]
            for v in variants
        ],
    )
    others = ", ".join(
        f"{v} {steady_share(v).median:.3f}x" for v in variants if v not in (NO_SAVES, ASYNC, SYNC, BUFFERED)
    )
    for v in (v for v in (ASYNC, SYNC) if v in variants):
        share, steady_median = ratio(rate(v).median, base), steady_share(v).median
        report.add(
            f"- Target (issue 16): throughput with a save every {args.every} steps at least 0.97x of no saves, {v}: "
            f"steady {steady_median:.3f}x, {verdict(steady_median >= 0.97)}; whole fit {share:.3f}x (steady: "
            f"{others or 'no other variant ran'})."
        )
    report.add(
        "- Steps/s = steps over the time from the start of training to the end of the fit, including the wait "
        "for the last save and its `.ckpt` file. Steady windows: the seconds per save interval a long run is "
        "made of, every window but each fit's first (the first save allocates the reused buffers) and last (the "
        "wait for the last save), pooled over the rounds; x no saves (steady) is, per round, the no-save fit's "
        "median steady window over the variant's (median [IQR] over rounds). CPU = user + system seconds of the "
        "training process and every process it started, our helper and DCP's process included "
        "(`common.cpu_seconds`), per step of the whole fit; its ratio is no-save CPU per step over the variant's. "
        "GPU busy: NVML's utilization read every 0.05 s, its mean over the steady windows (median [IQR] over "
        "rounds; `-` off a GPU)."
    )
    memory_table(report, {v: [r.memory for r in runs[v]] for v in variants}, NO_SAVES)
    report.add(f"- {MEMORY_NOTE}")


def added_fit(model: Net, variant: str, root: Path, steps: int, every: int) -> dict[str, float]:
    """One whole ``Trainer.fit()`` of ``steps`` steps saving every ``every``: wall and CPU seconds, saves made."""
    directory = Path(tempfile.mkdtemp(prefix="added-", dir=root))
    io = PLUGINS[variant](directory)
    end = TrainingEnd()
    callbacks: list[pl.Callback] = [end]
    if variant in (PERIODIC, PERIODIC_SYNC):
        callbacks.append(PeriodicCheckpoint(every_n_steps=every))
    elif variant != NO_SAVES:
        callbacks.append(CountedCheckpoint(dirpath=directory / "names", every_n_train_steps=every, save_top_k=-1))
    callbacks += variant_callbacks(io)
    run = trainer(steps, directory, model.accelerator, plugins=[io] if io is not None else None, callbacks=callbacks)
    data = loader(model, steps)
    gc.collect()
    with TreeMemory(keep=helpers(variant)) as memory:
        wall, cpu = now(), cpu_seconds()
        run.fit(model, data)
        manager = getattr(io, "_manager", None)  # our engine, which outlives the fit (its teardown drained it)
        if manager is not None:
            manager.drain()
        elif io is not None:
            drain(io)
        trained = end.at - wall
        wall, cpu = now() - wall, cpu_seconds() - cpu
    if manager is not None:
        saves = manager.stats.saves
        manager.close()  # ends its helper process and frees its shared-memory buffers (the plugin keeps them)
    else:
        saves = sum(c.saves for c in callbacks if isinstance(c, CountedCheckpoint))
    if isinstance(io, DcpProcessIO):
        if io.saver.saves != saves:
            raise RuntimeError(f"{variant}: {io.saver.saves} saves made, {saves} asked for")
        io.close()  # frees its staging buffers and groups, untimed as our engine's close
    del run, io, manager
    gc.collect()
    shutil.rmtree(directory, ignore_errors=True)
    return {"wall": wall, "cpu": cpu, "saves": saves, "trained": trained, **memory.sample()}


def added(args: Any, model: Net, root: Path, report: Report) -> None:
    variants = [ADDED_KEYS[key] for key in args.variants]
    names = [NO_SAVES, *variants]
    fits = paired_rounds(
        names, args.every, args.rounds, args.steps, lambda v, steps, n: added_fit(model, v, root, steps, n)
    )
    report_added(
        report,
        fits,
        steps=args.steps,
        no_saves=NO_SAVES,
        floor=FLOOR,
        rival=ASYNC_IO,
        ours=[v for v in (ASYNC, SYNC, PERIODIC, PERIODIC_SYNC, BUFFERED) if v in variants],
        notes=[
            "A run is one `Trainer.fit()`; its wall time runs from the `fit()` call to the last save complete "
            "(committed, for ours, and its `.ckpt` name written). TorchCheckpointIO's and AsyncCheckpointIO's "
            "`.ckpt` files go to the page cache without fsync; ours fsyncs its step and its name; the DCP recipe "
            "writes each checkpoint as a DCP directory at the name, fsynced (its fit ends when the last upload "
            "is done); the floor writes nothing."
        ],
    )
    report_memory(report, fits, NO_SAVES)


def main() -> None:
    p = parser(__doc__, size_gb=None, repeats=1)
    p.add_argument("--mode", choices=("blocking", "throughput", "added"), required=True)
    p.add_argument("--saves", type=int, default=4, help="blocking: saves per fit (default %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="throughput, added: steps per fit (default 100, 16)")
    p.add_argument(
        "--every",
        type=int,
        nargs="+",
        default=None,
        help="steps between saves: throughput one value (default 10); added one or more (default 4 8)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=BATCH,
        help="rows per step (default %(default)s): more is more compute per step against the same state",
    )
    p.add_argument(
        "--accelerator",
        choices=("cpu", "gpu"),
        default="cpu",
        help="cpu (default), or gpu: one CUDA device, each step's input made once on it (no host batches)",
    )
    p.add_argument("--rounds", type=int, default=3, help="added: paired rounds after a warm-up (default %(default)s)")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(ADDED_KEYS),
        default=list(ADDED_DEFAULT),
        help="variants besides the no-save fit (default %(default)s); blocking and throughput save through "
        "trainer.save_checkpoint(path), which names, so ours-periodic(-sync) is for added only",
    )
    args = parse(p)
    if args.mode != "added" and {"ours-periodic", "ours-periodic-sync"} & set(args.variants):
        p.error("ours-periodic and ours-periodic-sync (PeriodicCheckpoint, no .ckpt names) are for --mode added only")
    args.size_gb = args.size_gb or {"blocking": 1.6, "throughput": 0.4, "added": 1.6}[args.mode]
    args.steps = args.steps or (16 if args.mode == "added" else 100)
    if args.mode == "added":
        args.every = args.every or [4, 8]
    elif args.every and len(args.every) > 1:
        p.error("--every takes one value in this mode")
    else:
        args.every = args.every[0] if args.every else 10
    if args.mode == "throughput" and args.steps < 3 * args.every:
        # the steady state is every save interval but a fit's first and last: a fit needs a third
        p.error(f"--steps {args.steps}: throughput needs at least 3 save intervals (3 x --every = {3 * args.every})")
    width = width_for(args.size_gb)
    model = Net(width, batch=args.batch, accelerator=args.accelerator)
    size = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # values and Adam's two moments
    if args.mode == "blocking":
        what = (
            f"{args.saves} saves per fit, every 2nd step, each waited for at the end of the next step; "
            f"{args.repeats} round(s)"
        )
    elif args.mode == "throughput":
        what = f"{args.steps} steps per fit, a save every {args.every} steps; {args.repeats} round(s)"
    else:
        what = (
            f"{args.steps} steps per fit, ModelCheckpoint(every_n_train_steps=N, save_top_k=-1) for N in "
            f"{', '.join(map(str, args.every))}; {args.rounds} paired round(s) after a warm-up round"
        )
    title = {
        "blocking": "blocking time per save",
        "throughput": "training throughput",
        "added": "added wall time per save in a real fit",
    }[args.mode]
    report = Report(
        f"Lightning: {title} (issue 3)",
        f"LightningModule of {LAYERS} x Linear({width}, {width}) + Adam = {size / 1e9:.2f} GB, batch {args.batch}, "
        f"Trainer(accelerator='{args.accelerator}'); {what}, variants in rotating order; median [IQR] in seconds",
    )
    try:
        with scratch(args.dir, "lightning") as root:
            {"blocking": blocking, "throughput": throughput, "added": added}[args.mode](args, model, root, report)
    finally:
        end_checkpoint_process()  # DCP's, kept from fit to fit as a training process keeps it
    report.print()


if __name__ == "__main__":
    main()
