"""The Hugging Face Trainer: what its saves add to training, its own checkpoint against the pack's.

One process on CPU (``use_cpu=True``), one torch thread: a ``PreTrainedModel`` of 8 x Linear(w, w) with AdamW
(``adamw_torch``), w from --size-gb (1.6 GB of parameters and Adam moments gives w = 4096, the state of the other
benchmarks), batch 8 of synthetic data, --steps steps (default 16) per ``trainer.train()``. Every N steps (each N of
--every, default 4 and 8) the Trainer saves, as ``save_steps=N`` and ``save_total_limit=2`` ask:

- the Trainer's own save: ``checkpoint-<step>/`` with ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
  ``rng_state.pth``, ``trainer_state.json``, ``config.json`` and ``training_args.bin``, written before training goes
  on (not fsynced);
- ours: the same Trainer after ``attach_trainer(trainer, ResiliencePlugin(...))``, asynchronous staging (the
  default) or synchronous; checkpoints in ``<output_dir>/resilience``, fsynced before each commit.

Next to them the same run with ``save_strategy="no"``. A run's wall time spans ``train()``: for ours the engine's
start (its helper process) and the wait for the last commit, which ``train()`` does before it returns. "Trained" is
the time until the Trainer's ``on_train_end``, before that wait. Paired rounds, medians [IQR] and the once-per-run
and per-save split as in ``bench_accelerate --mode added`` (``common.report_added``); CPU seconds count the training
process and every process it started.

    .venv/bin/python -m benchmarks.bench_transformers [--size-gb 1.6] [--steps 16] [--every 4 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from torch import nn
from torch.utils.data import Dataset
from transformers import PretrainedConfig, PreTrainedModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments

from accelerate_resilience import ResiliencePlugin
from accelerate_resilience.transformers import attach_trainer
from benchmarks.common import (
    DEFAULT_SIZE_GB,
    LAYERS,
    NO_SAVES,
    OURS_ASYNC,
    OURS_SYNC,
    Report,
    Sample,
    cpu_seconds,
    now,
    paired_rounds,
    report_added,
    scratch,
    setup_torch,
    width_for,
)

BATCH = 8
STOCK = "Trainer's own save"
VARIANTS = {"stock": STOCK, "async": OURS_ASYNC, "sync": OURS_SYNC}


class WideConfig(PretrainedConfig):
    model_type = "bench-wide"

    def __init__(self, width: int = 64, layers: int = LAYERS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.width, self.layers = width, layers


class Wide(PreTrainedModel):
    """``layers`` x Linear(width, width); the loss is the output's mean square."""

    config_class = WideConfig

    def __init__(self, config: WideConfig) -> None:
        super().__init__(config)
        self.stack = nn.Sequential(*(nn.Linear(config.width, config.width) for _ in range(config.layers)))
        self.post_init()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.stack(x).square().mean()}


class Inputs(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, width: int) -> None:
        self.x = torch.randn(n, width)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index]}


class TrainEnd(TrainerCallback):
    """When training ended (``on_train_end``), before our wait for the last commit."""

    at: float | None = None

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        self.at = now()


def run(model: Wide, data: Inputs, variant: str, root: Path, steps: int, every: int) -> Sample:
    """One ``train()`` of ``steps`` steps saving every ``every``: wall and CPU seconds, saves made."""
    output = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    args = TrainingArguments(
        output_dir=str(output),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        optim="adamw_torch",
        learning_rate=1e-4,
        save_strategy="no" if variant == NO_SAVES else "steps",
        save_steps=every,
        save_total_limit=2,
        logging_strategy="no",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    end = TrainEnd()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[end])
    trainer.remove_callback(PrinterCallback)  # its lines would go into the report (stdout)
    if variant in (OURS_ASYNC, OURS_SYNC):
        attach_trainer(trainer, ResiliencePlugin(async_staging=variant == OURS_ASYNC, goodput=False))
    gc.collect()
    start, cpu = now(), cpu_seconds()
    trainer.train()
    wall, cpu = now() - start, cpu_seconds() - cpu
    if end.at is None:
        raise RuntimeError(f"{variant}: the Trainer's on_train_end never came")
    trained = end.at - start
    saves = 0 if variant == NO_SAVES else steps // every
    del trainer
    gc.collect()
    shutil.rmtree(output, ignore_errors=True)
    return {"wall": wall, "cpu": cpu, "saves": saves, "trained": trained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=DEFAULT_SIZE_GB, help="model + Adam state, GB")
    parser.add_argument("--steps", type=int, default=16, help="steps per run (default %(default)s)")
    parser.add_argument("--every", type=int, nargs="+", default=[4, 8], help="steps between saves")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds after a warm-up (default 3)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    setup_torch(args.threads)
    width = width_for(args.size_gb)
    model = Wide(WideConfig(width=width))
    size = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # values and Adam's two moments
    variants = [VARIANTS[key] for key in args.variants]
    report = Report(
        "Hugging Face Trainer: added wall time per save, its own checkpoint against ours",
        f"{LAYERS} x Linear({width}, {width}) in a PreTrainedModel + AdamW = {size / 1e9:.2f} GB, batch {BATCH}, "
        f"Trainer(use_cpu=True), one process, transformers {transformers.__version__}; {args.steps} steps per "
        f"train(), save_steps N for N in {', '.join(map(str, args.every))}, save_total_limit=2; {args.rounds} "
        "paired round(s) after a warm-up round, variants in rotating order; median [IQR] in seconds",
    )
    with scratch(args.dir, "transformers") as root:
        data = Inputs(args.steps * BATCH, width)
        fits = paired_rounds(
            [NO_SAVES, *variants],
            args.every,
            args.rounds,
            args.steps,
            lambda variant, steps, every: run(model, data, variant, root, steps, every),
        )
    report_added(
        report,
        fits,
        steps=args.steps,
        no_saves=NO_SAVES,
        floor="",
        rival=STOCK,
        ours=[v for v in (OURS_ASYNC, OURS_SYNC) if v in variants],
        notes=[
            "A run spans `train()`: ours starts its engine there and waits there for its last commit. The Trainer's "
            "files go to the page cache without fsync; ours fsyncs each checkpoint before it commits it."
        ],
    )
    report.print()


if __name__ == "__main__":
    main()
