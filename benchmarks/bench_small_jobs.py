"""Small jobs: what the pack adds to a whole short run with a tiny state, per run and per save (issue "The first
hour of a new user", item 8).

A user who trains a small model (a 112-287 KiB state) pays the pack's fixed costs, which a large state hides:
process start and imports, the helper process's fork server, the engine's and the health guard's start, the
waits at the end of a run, and per save whatever does not scale with the bytes (fsyncs, manifests, the ``.ckpt``
name written before ``save_checkpoint`` returns below ``sync_names_below_mb``). Each run here is a fresh
process, timed from just before it is started until it has exited, so all of that is counted.

Lightning: ``Trainer(accelerator="cpu", devices=--devices, max_steps=--steps)`` fitting an MLP (``--width``; the
default 128-wide, 3-layer MLP with Adam is a 244 KiB state) on synthetic data with ``ModelCheckpoint(
every_n_train_steps=--every)`` (Lightning's default plugin, strategy ``"ddp"`` on 2 or more devices), against the
same with the README's snippet: ``ResilientCheckpointIO`` (``async_staging=True``), ``AutoResume``,
``HealthGuardCallback`` and ``GoodputMonitor`` (strategy ``"resilient_ddp"``). Accelerate: the same MLP in a plain
loop with ``ProjectConfiguration(automatic_checkpoint_naming=True)`` and ``accelerator.save_state()`` every --every
steps, against the same script with ``attach(accelerator, ResiliencePlugin(every_n_steps=--every, health=True))``,
``resume()`` and ``timed()`` (the saves are then the plugin's); on 2 or more devices both are started by
``accelerate launch --multi_gpu --num_processes N`` with ``Accelerator(cpu=True)``.

Each run reports: wall (spawn to exit), start (spawn to the first training step: interpreter, imports, model,
Trainer or Accelerator set-up, the pack's start and resume), loop (first step's start to the last step's end,
saves inside), end (the last step's end to the return of ``fit()`` / ``end_training()``: the wait for the last
save, teardown), exit (that return to the process's exit: interpreter shutdown, exit hooks) and the pack's
checkpoint stall as ``resilience report`` shows it. A paired difference (ours - plain, same round) per round;
medians over --repeats rounds after one warm-up round, variants in an order that rotates every round. Per save:
the stall the report shows over the run's saves, and the loop's paired difference over them (which also holds
what ours adds to every step, e.g. the health check's agreement under DDP).

    .venv/bin/python -m benchmarks.bench_small_jobs [--steps 300] [--every 25] [--width 128] [--devices 1] [--repeats 3]
    .venv/bin/python -m benchmarks.bench_small_jobs --only lightning --profile DIR   # a cProfile of every run
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Report, Stats, emit, parse, parser, results_in, rotated, scratch, worker_env

FRAMEWORKS = ("lightning", "accelerate")
PLAIN, OURS = "plain", "ours"
BATCH, FEATURES = 16, 32


def mlp(width: int) -> Any:
    """Three linear layers, 32 -> width -> width -> 1: with Adam's two moments, 12 bytes of state per parameter."""
    import torch

    layers = [torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def state_kib(width: int) -> float:
    return 12 * sum(p.numel() for p in mlp(width).parameters()) / 1024


def dataset(steps: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH, FEATURES, generator=gen)
    return TensorDataset(x, x[:, :1] * 0.5)


# ---- the workers: one whole run each ----------------------------------------------------------------------------


def lightning_run(variant: str, root: Path, args: Any, marks: dict[str, float]) -> None:
    """``Trainer.fit`` of the MLP, saving through ModelCheckpoint every ``every`` steps."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader

    steps, every = args.steps, args.every
    callbacks: list[Any] = [ModelCheckpoint(dirpath=root / "named", every_n_train_steps=every)]
    plugins: list[Any] = []
    if variant == OURS:
        from lightning_resilience import AutoResume, GoodputMonitor, HealthGuardCallback, ResilientCheckpointIO

        io = ResilientCheckpointIO(str(root / "checkpoints"), async_staging=True)
        plugins.append(io)
        callbacks += [AutoResume(io), HealthGuardCallback(), GoodputMonitor()]

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(args.width)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Marks(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            marks.setdefault("loop_start", time.time())

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            marks["loop_end"] = time.time()

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="auto" if args.devices == 1 else "resilient_ddp" if variant == OURS else "ddp",
        max_steps=steps,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=plugins,
        callbacks=[*callbacks, Marks()],
    )
    trainer.fit(Net(), DataLoader(dataset(steps * args.devices), batch_size=BATCH))  # one epoch on every rank


def accelerate_run(variant: str, root: Path, args: Any, marks: dict[str, float]) -> None:
    """A plain Accelerate loop calling ``save_state()`` every ``every`` steps, or the plugin saving at that interval."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from torch.utils.data import DataLoader

    every = args.every
    project = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(cpu=True, project_config=project)
    model = mlp(args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset(args.steps * args.devices), batch_size=BATCH)  # prepare() shares it out
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    handle = None
    if variant == OURS:
        from accelerate_resilience import ResiliencePlugin, attach

        plugin = ResiliencePlugin(local_root=str(root / "checkpoints"), every_n_steps=every, health=True)
        handle = attach(accelerator, plugin)
        handle.resume()
    batches = handle.timed(loader) if handle is not None else loader
    for step, (x, y) in enumerate(batches, start=1):
        marks.setdefault("loop_start", time.time())
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if handle is None and step % every == 0:
            accelerator.save_state()
        marks["loop_end"] = time.time()
    accelerator.end_training()


def worker(framework: str, variant: str, root: Path, args: Any) -> None:
    """One run; its time marks (epoch seconds) on stdout, the last at the return of the run, before exit."""
    marks: dict[str, float] = {}
    run = lightning_run if framework == "lightning" else accelerate_run
    if args.profile:
        import cProfile

        cProfile.runctx("run(variant, root, args, marks)", globals(), locals(), args.profile)
    else:
        run(variant, root, args, marks)
    marks["returned"] = time.time()
    if os.environ.get("LOCAL_RANK", "0") == "0":  # the other ranks are copies of this process
        emit({"marks": marks, "saves": args.steps // args.every})


# ---- the benchmark: fresh processes in rotating order ------------------------------------------------------------


def one_run(framework: str, variant: str, parent: Path, args: Any, profile_dir: str | None) -> dict[str, float]:
    """Spawn one run; its phases in seconds, and the stall ``resilience report`` shows for ours."""
    root = Path(parent) / f"{framework}-{variant}-{time.monotonic_ns()}"
    root.mkdir()
    profile = os.path.join(profile_dir, f"{framework}-{variant}-{root.name}.prof") if profile_dir else ""
    command = [sys.executable, "-m", "benchmarks.bench_small_jobs", "--worker", framework, "--variant", variant]
    if framework == "accelerate" and args.devices > 1:  # Lightning starts its other ranks itself
        launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(args.devices)]
        command[1:2] = [*launch, "-m"]
    for option in ("root", "steps", "every", "width", "devices", "threads"):
        command += [f"--{option}", str(root if option == "root" else getattr(args, option))]
    command += ["--profile", profile] if profile else []
    env = worker_env({"OMP_NUM_THREADS": "1"})
    start = time.time()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    exited = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    (result,) = results_in(proc.stdout)
    m = result["marks"]
    sample = {
        "wall": exited - start,
        "start": m["loop_start"] - start,
        "loop": m["loop_end"] - m["loop_start"],
        "end": m["returned"] - m["loop_end"],
        "exit": exited - m["returned"],
        "saves": result["saves"],
    }
    if variant == OURS:
        sample.update(reported_stall(root))  # the run directory: default_root_dir, project_dir
    return sample


def reported_stall(run_dir: Path) -> dict[str, float]:
    """The checkpoint bucket of ``resilience report --json``: seconds, and its share of the wall time."""
    command = [sys.executable, "-m", "resilience.cli", "report", str(run_dir), "--json"]
    proc = subprocess.run(command, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=120, check=True)
    summary = json.loads(proc.stdout)
    stall, wall = summary["buckets"]["checkpoint"], summary["wall_s"]
    return {"stall": stall, "stall_share": stall / wall if wall else 0.0}


def measure(framework: str, args: Any, parent: Path) -> dict[str, list[dict[str, float]]]:
    samples: dict[str, list[dict[str, float]]] = {PLAIN: [], OURS: []}
    for round_ in range(1 + args.repeats):  # the first round warms the page cache and torch's lazy loads
        for variant in rotated([PLAIN, OURS], round_):
            sample = one_run(framework, variant, parent, args, args.profile)
            print(f"{framework} round {round_}: {variant}: {sample}", file=sys.stderr, flush=True)
            if round_:
                samples[variant].append(sample)
    return samples


def report_framework(report: Report, framework: str, samples: dict[str, list[dict[str, float]]]) -> None:
    keys = ("wall", "start", "loop", "end", "exit")
    report.heading(framework.capitalize())
    rows = [[v, *(Stats.of(s[k] for s in samples[v]).fmt(2) for k in keys)] for v in (PLAIN, OURS)]
    pairs = list(zip(samples[OURS], samples[PLAIN], strict=True))
    rows.append(["ours - plain", *(Stats.of(o[k] - p[k] for o, p in pairs).fmt(2) for k in keys)])
    report.table(["variant", "wall s", "start s", "loop s", "end s", "exit s"], rows)
    saves = samples[OURS][0]["saves"]
    per_save = Stats.of((o["loop"] - p["loop"]) / saves for o, p in pairs)
    loop_ratio = Stats.of(o["loop"] / p["loop"] for o, p in pairs)
    stall = Stats.of(o["stall"] for o in samples[OURS])
    share = Stats.of(100 * o["stall_share"] for o in samples[OURS])
    report.add(
        f"- {saves} saves a run. Checkpoint stall in `resilience report`: {stall.fmt(3)} s a run "
        f"({share.fmt(1)}% of its wall time), {stall.median / saves * 1000:.1f} ms a save. Loop time ours - plain: "
        f"{per_save.fmt(1, 1000)} ms a save; ours' loop / plain's {loop_ratio.fmt(3)}."
    )


def main() -> None:
    p = parser(__doc__, size_gb=None)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default %(default)s)")
    p.add_argument("--every", type=int, default=25, help="a save every N steps (default %(default)s)")
    p.add_argument("--width", type=int, default=128, help="the MLP's hidden width (default %(default)s: 244 KiB)")
    p.add_argument("--devices", type=int, default=1, help="Lightning's CPU processes (DDP when 2 or more)")
    p.add_argument("--only", choices=FRAMEWORKS, default=None, help="one framework only")
    p.add_argument("--profile", default=None, help="write a cProfile of every run's process into this folder")
    p.add_argument("--worker", choices=FRAMEWORKS, help="(internal) run one job and report its time marks")
    p.add_argument("--variant", choices=(PLAIN, OURS), default=PLAIN, help="(internal) with or without the pack")
    p.add_argument("--root", default=None, help="(internal) the run's folder")
    args = parse(p)
    if args.worker:
        worker(args.worker, args.variant, Path(args.root), args)
        return
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    report = Report(
        "Small jobs: the pack's fixed costs on a whole short run",
        f"{args.steps} steps, a save every {args.every}, MLP width {args.width} ({state_kib(args.width):.0f} KiB "
        f"with Adam), {args.devices} CPU process(es) per run, {args.repeats} rounds after a warm-up",
    )
    with scratch(args.dir, "small") as parent:
        for framework in (args.only,) if args.only else FRAMEWORKS:
            report_framework(report, framework, measure(framework, args, parent))
    report.add(
        "- wall: spawn to exit; start: spawn to the first step; loop: first step to last step (saves inside); "
        "end: last step to the return of fit()/end_training(); exit: that return to the process's exit. "
        "Medians [IQR]; ours - plain is paired by round."
    )
    report.print()


if __name__ == "__main__":
    main()
