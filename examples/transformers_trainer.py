"""Resilient training with the Hugging Face Trainer: asynchronous checkpoints, exact resume, a clean stop on
preemption. The only additions to a plain Trainer script are marked ``# resilience``.

A tiny GPT-2 made from a config, on made-up token data: nothing is downloaded. One process:

    python examples/transformers_trainer.py --ckpt /tmp/hf-ckpt --steps 60

Two CPU processes:

    accelerate launch --multi_gpu --num_processes 2 examples/transformers_trainer.py --ckpt /tmp/hf-ckpt --steps 60

Stop it any way you like (Ctrl-C, ``kill -9``) and run the same command again: it continues from the newest
committed checkpoint with the weights, optimizer, schedule, random numbers and batches an uninterrupted run would
have had. The last line printed is ``FINAL_SHA256 <digest of the trained weights>``, the same either way.
``resilience report /tmp/hf-ckpt`` shows where the wall time of every run went.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is made locally

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from accelerate_resilience import ResiliencePlugin
from accelerate_resilience.transformers import attach_trainer

VOCAB, LENGTH = 128, 32


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """``n`` made-up token sequences, each the same in every run (drawn from a generator seeded by its index)."""

    def __init__(self, n: int = 256) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def weights_digest(model: Any) -> str:
    """SHA-256 over every weight's name and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def make_trainer(
    output_dir: str, steps: int, save_every: int, samples: int = 256, eval_samples: int = 0, **settings: Any
) -> Trainer:
    """A tiny GPT-2 (two layers, dropout 0.1: a resume must restore the RNG streams) and its Trainer on ``samples``
    sequences (and ``eval_samples`` to evaluate on), saving every ``save_every`` steps; ``settings`` override the
    ``TrainingArguments``."""
    set_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    arguments: dict[str, Any] = {
        "output_dir": output_dir,
        "max_steps": steps,
        "save_steps": save_every,
        "save_total_limit": 3,
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-3,
        "warmup_steps": 5,
        "logging_steps": 10,
        "seed": 0,
        "use_cpu": not torch.cuda.is_available(),
        "report_to": "none",
        "disable_tqdm": True,
        **settings,
    }
    model = GPT2LMHeadModel(config)
    evaluation = Tokens(eval_samples) if eval_samples else None
    return Trainer(model, TrainingArguments(**arguments), train_dataset=Tokens(samples), eval_dataset=evaluation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="output directory; the pack's checkpoints go to DIR/resilience")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps in all")
    parser.add_argument("--save-every", type=int, default=5, help="save every N optimizer steps")
    args = parser.parse_args()

    trainer = make_trainer(args.ckpt, args.steps, args.save_every)
    attach_trainer(trainer, ResiliencePlugin(health=True))  # resilience: SIGTERM saves the step and exits 75
    trainer.train(resume_from_checkpoint=True)  # resilience: the newest committed checkpoint, if any
    if trainer.is_world_process_zero():
        print(f"FINAL_SHA256 {weights_digest(trainer.model)}", flush=True)


if __name__ == "__main__":
    main()
