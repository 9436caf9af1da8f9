"""Resume: from process start to the first training step after loading, ours against Lightning's own load.

One process trains a step and saves the same state twice: through ours (``ResilientCheckpointIO``) and through
Lightning's TorchCheckpointIO (one ``.ckpt`` file). Then fresh processes take turns: ours (``AutoResume`` finds
and loads the newest committed checkpoint, ``trainer.fit(model)``), Lightning's own (``trainer.fit(model,
ckpt_path=...ckpt)``), and the floor, a process that only reads the checkpoint's bytes into memory. Each
process reports when its first resumed step started and ended; the time counts from just before the process
was started. The files were just written: Lightning's ``.ckpt`` went through the page cache, ours past it
(``direct_io``), so ours is read from the disk by the first process that reads it and from the cache after
that. ``--cold`` drops the page cache (root only) before every process, so each reads its files from the disk,
as a relaunch on a rebooted or replaced node does.

Ours runs with its defaults, so its time holds all a default resume does: the engine's start, whose helper
process (``persist="process"``) comes from a fork server that imports torch and the engine in an interpreter of
its own, discovery with full verification (``verify="auto"`` checksums every local shard before trusting the
checkpoint), and the load. Lightning's own load is one ``torch.load`` of its ``.ckpt``, unverified.

    .venv/bin/python -m benchmarks.bench_resume [--size-gb 1.6] [--repeats 3] [--dir DIR] [--cold]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    LAYERS,
    ROOT,
    Report,
    Stats,
    emit,
    parser,
    ratio,
    results_in,
    rotated,
    run_worker,
    scratch,
    setup_torch,
    width_for,
    worker_env,
)

OURS, LIGHTNING, FLOOR = "ours (AutoResume)", "Lightning's own load (ckpt_path=)", "floor: read the bytes"
SAVED_STEP = 1


def prepare(root: Path, size_gb: float) -> None:
    """Train one step and save the same state in both formats."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from benchmarks.bench_lightning import Net, loader, trainer
    from lightning_resilience import ResilientCheckpointIO
    from resilience.checkpoint.tree import tensor_bytes

    model = Net(width_for(size_gb))
    io = ResilientCheckpointIO(str(root / "ours"))
    run = trainer(SAVED_STEP, root, plugins=[io])
    run.fit(model, loader(model, SAVED_STEP))
    run.save_checkpoint(str(root / "ours.ckpt"))
    io.teardown()  # waits for the commit
    run.strategy.checkpoint_io = TorchCheckpointIO()
    run.save_checkpoint(str(root / "plain.ckpt"))
    emit({"state": tensor_bytes(run.lightning_module.state_dict()) + tensor_bytes(run.optimizers[0].state_dict())})


def resume(variant: str, root: Path, size_gb: float, verify: str) -> None:
    """Resume the saved run and report when the first step after loading started and ended."""
    import lightning.pytorch as pl

    from benchmarks.bench_lightning import Net, loader, trainer
    from lightning_resilience import AutoResume, ResilientCheckpointIO

    imported = time.time()

    class FirstStep(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.start = getattr(self, "start", time.time())

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.end = getattr(self, "end", time.time())
            self.step = trainer.global_step

    first = FirstStep()
    model = Net(width_for(size_gb))
    if variant == OURS:
        run = trainer(
            SAVED_STEP + 1,
            root,
            plugins=[ResilientCheckpointIO(str(root / "ours"), verify=verify)],
            callbacks=[AutoResume(), first],
        )
        run.fit(model, loader(model, SAVED_STEP + 1))
    else:
        run = trainer(SAVED_STEP + 1, root, callbacks=[first])
        run.fit(model, loader(model, SAVED_STEP + 1), ckpt_path=str(root / "plain.ckpt"))
    if first.step != SAVED_STEP + 1:
        raise RuntimeError(f"{variant}: the first step trained was {first.step}, not a resumed {SAVED_STEP + 1}")
    emit({"imported": imported, "start": first.start, "end": first.end})


def read_floor(root: Path) -> None:
    """Read every byte of our checkpoint into memory, with nothing but the interpreter loaded."""
    files = [path for path in (root / "ours").rglob("*") if path.is_file()]
    buffer = bytearray(max(path.stat().st_size for path in files))
    for path in files:
        with path.open("rb", buffering=0) as stream:
            while stream.readinto(buffer):
                pass
    emit({"end": time.time()})


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache() -> None:
    """Write back dirty pages, then drop every clean page cached (all files of the machine: root only)."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as control:
            control.write("1\n")
    except OSError as exc:
        raise SystemExit(f"--cold needs to write {DROP_CACHES} (root, a writable /proc): {exc}") from None


def launch(variant: str, root: Path, args: argparse.Namespace) -> dict[str, float]:
    """Start a worker process; its report's times relative to the moment before the start."""
    if args.cold:
        drop_page_cache()
    command = [sys.executable, "-m", "benchmarks.bench_resume", "--worker", variant, "--dir", str(root)]
    command += ["--size-gb", str(args.size_gb), "--threads", str(args.threads), "--verify", args.verify]
    started = time.time()
    proc = subprocess.run(command, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    (result,) = results_in(proc.stdout)
    return {key: value - started for key, value in result.items()}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--worker", choices=("prepare", OURS, LIGHTNING, FLOOR), help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help="drop the page cache before every process (root only)")
    p.add_argument(
        "--verify",
        choices=("auto", "full"),
        default="auto",
        help="ours: 'auto' (the default) trusts this node's proofs of its own shards, 'full' hashes every file",
    )
    args = p.parse_args()
    if args.worker == FLOOR:  # before anything imports torch
        read_floor(Path(args.dir))
        return
    setup_torch(args.threads)
    if args.worker == "prepare":
        prepare(Path(args.dir), args.size_gb)
        return
    if args.worker:
        resume(args.worker, Path(args.dir), args.size_gb, args.verify)
        return

    width = width_for(args.size_gb)
    report = Report(
        "Resume: process start to first resumed step (item 5)",
        f"Lightning, {LAYERS} x Linear({width}, {width}) + Adam, one CPU process per resume; {args.repeats} "
        "rounds, variants in rotating order; median [IQR] in seconds from process start; page cache "
        + ("dropped before every process (--cold)" if args.cold else "as the writes and earlier reads left it")
        + f"; ours with verify={args.verify!r}",
    )
    samples: dict[str, list[dict[str, float]]] = {OURS: [], LIGHTNING: [], FLOOR: []}
    with scratch(args.dir, "resume") as root:
        (prepared,), _ = run_worker(
            "benchmarks.bench_resume",
            ["--worker", "prepare", "--dir", str(root), "--size-gb", str(args.size_gb), "--threads", str(args.threads)],
            timeout=900,
        )
        for round_ in range(args.repeats):
            for variant in rotated(list(samples), round_):
                samples[variant].append(launch(variant, root, args))

    def col(variant: str, key: str) -> Stats:
        return Stats.of(s[key] for s in samples[variant] if key in s)

    report.table(
        ["variant", "imports done", "first step starts", "first step done", "x floor (first step done)"],
        [
            [
                v,
                col(v, "imported").fmt(),
                col(v, "start").fmt(),
                col(v, "end").fmt(),
                f"{ratio(col(v, 'end').median, col(FLOOR, 'end').median):.1f}",
            ]
            for v in samples
        ],
    )
    ours, theirs = col(OURS, "end").median, col(LIGHTNING, "end").median
    report.add(
        f"- State: {prepared['state'] / 1e9:.2f} GB. Ours / Lightning's own: {ratio(ours, theirs):.2f}x "
        f"(first resumed step done at {ours:.2f} s vs {theirs:.2f} s). The floor's process imports nothing "
        "but the standard library; the gap between it and 'imports done' is the cost of importing torch and "
        "Lightning, the same for both resumes."
    )
    report.print()


if __name__ == "__main__":
    main()
