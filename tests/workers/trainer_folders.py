"""A Hugging Face Trainer run, with the pack or without it (``--stock``), for the checkpoint-N folder tests.

    python trainer_folders.py --out DIR --steps N --save-every K [--width W] [--stock] [--resume PATH|true]

The tiny GPT-2 of ``examples/transformers_trainer.py`` (``--width`` widens it: a state over the 64 MiB below which
a folder is written before the save returns), on 48 made-up sequences: 6 steps an epoch in one process, 3 on two
ranks under torchrun. Rank 0 prints ``FINAL_SHA256 <digest of the weights>`` last.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from accelerate_resilience import ResiliencePlugin
from accelerate_resilience.transformers import attach_trainer
from examples.transformers_trainer import LENGTH, VOCAB, Tokens, weights_digest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--stock", action="store_true", help="the Trainer alone, without the pack")
    parser.add_argument("--resume", default=None, help="a checkpoint folder, or 'true' for the newest")
    args = parser.parse_args()
    set_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=args.width, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    arguments = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        save_steps=args.save_every,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=5,
        seed=0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(GPT2LMHeadModel(config), arguments, train_dataset=Tokens(48))
    if not args.stock:
        attach_trainer(trainer, ResiliencePlugin())
    trainer.train(resume_from_checkpoint=True if args.resume == "true" else args.resume)
    if trainer.is_world_process_zero():
        print(f"FINAL_SHA256 {weights_digest(trainer.model)}", flush=True)


if __name__ == "__main__":
    main()
