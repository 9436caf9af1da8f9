"""Lightning Fabric: what ``fabric.save`` adds to training, Fabric's own save (``torch.save``) against the pack's.

One process on CPU (``Fabric(accelerator="cpu", devices=1)``, Fabric's single-device strategy), one torch thread:
8 x Linear(w, w) with Adam (``common.build``), w from --size-gb (1.6 GB of parameters and Adam moments gives
w = 4096, the state of the other benchmarks), batch 8 of synthetic data, --steps steps (default 16) per run. Every N
steps (each N of --every, default 4 and 8) the loop calls ``fabric.save("<run>/last.ckpt", state)`` with the
model, the optimizer and the step:

- Fabric's own save: ``TorchCheckpointIO``, ``torch.save`` of the whole dict before training goes on (not
  fsynced);
- ours: the same loop with ``plugins=[ResilientCheckpointIO(<run>/ckpt)]`` and ``resume(fabric, state)`` before
  it, asynchronous staging or synchronous; each save a committed step (fsynced) and ``last.ckpt`` written from it
  in the background.

Next to them the same loop without saves. A run's wall time spans the loop and ``fabric.strategy.teardown()``
after it, which for ours waits for the last commit and file; "trained" ends before that teardown. Paired rounds,
medians [IQR] and the once-per-run and per-save split as in ``bench_transformers`` (``common.report_added``); CPU
seconds count the training process and every process it started.

    .venv/bin/python -m benchmarks.bench_fabric [--size-gb 1.6] [--steps 16] [--every 4 8] [--repeats 3]
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path

import lightning
import torch
from lightning.fabric import Fabric

from benchmarks.common import (
    LAYERS,
    NO_SAVES,
    OURS_ASYNC,
    OURS_SYNC,
    Report,
    Sample,
    build,
    cpu_seconds,
    now,
    parse,
    parser,
    report_paired_rounds,
    width_for,
)
from lightning_resilience.fabric import ResilientCheckpointIO, resume

BATCH = 8
STOCK = "fabric.save, Fabric's own"
VARIANTS = {"stock": STOCK, "async": OURS_ASYNC, "sync": OURS_SYNC}


def run(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, variant: str, root: Path, steps: int, every: int
) -> Sample:
    """One loop of ``steps`` steps saving every ``every``: wall and CPU seconds, saves made."""
    folder = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    ours = variant in (OURS_ASYNC, OURS_SYNC)
    plugins = [ResilientCheckpointIO(str(folder / "ckpt"), async_staging=variant == OURS_ASYNC)] if ours else []
    gc.collect()
    start, cpu = now(), cpu_seconds()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugins)
    fabric.launch()
    wrapped, wrapped_optimizer = fabric.setup(model, optimizer)
    state = {"model": wrapped, "optimizer": wrapped_optimizer, "step": 0}
    if ours:
        resume(fabric, state)  # nothing to load: the line a resumable loop has
    width = model[0].in_features  # type: ignore[index]
    while state["step"] < steps:
        fabric.backward(wrapped(torch.randn(BATCH, width)).square().mean())
        wrapped_optimizer.step()
        wrapped_optimizer.zero_grad()
        state["step"] += 1
        if variant != NO_SAVES and state["step"] % every == 0:
            fabric.save(folder / "last.ckpt", state)
    trained = now() - start
    fabric.strategy.teardown()  # ours: the last commit and file
    wall, cpu = now() - start, cpu_seconds() - cpu
    saves = 0 if variant == NO_SAVES else steps // every
    del fabric, wrapped, wrapped_optimizer, state
    gc.collect()
    shutil.rmtree(folder, ignore_errors=True)
    return {"wall": wall, "cpu": cpu, "saves": saves, "trained": trained}


def main() -> None:
    p = parser(__doc__)  # --size-gb, --repeats (the paired rounds), --dir, --threads
    p.add_argument("--steps", type=int, default=16, help="steps per run (default %(default)s)")
    p.add_argument("--every", type=int, nargs="+", default=[4, 8], help="steps between saves")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parse(p)
    width = width_for(args.size_gb)
    model, optimizer, size = build(LAYERS, width)
    variants = [VARIANTS[key] for key in args.variants]
    report = Report(
        "Lightning Fabric: added wall time per save, fabric.save's own against ours",
        f"{LAYERS} x Linear({width}, {width}) + Adam = {size / 1e9:.2f} GB, batch {BATCH}, Fabric(accelerator='cpu', "
        f"devices=1), one process, lightning {lightning.__version__}; {args.steps} steps per run, fabric.save every N "
        f"for N in {', '.join(map(str, args.every))}; {args.repeats} paired round(s) after a warm-up round, variants "
        "in rotating order; median [IQR] in seconds",
    )
    report_paired_rounds(
        report,
        args,
        variants,
        lambda variant, root, steps, every: run(model, optimizer, variant, root, steps, every),
        rival=STOCK,
        ours=[OURS_ASYNC, OURS_SYNC],
        no_saves=NO_SAVES,
        notes=[
            "A run spans the loop and `fabric.strategy.teardown()`: ours starts its engine in the loop's first save "
            "(its helper process) and waits in the teardown for its last commit and file. Fabric's own file goes to "
            "the page cache without fsync; ours fsyncs each checkpoint before it commits it, then writes the file "
            "at the path from the committed checkpoint, so it writes the state twice per save."
        ],
    )
    report.print()


if __name__ == "__main__":
    main()
