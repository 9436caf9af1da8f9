"""An Accelerate job that prepares a model and no optimizer (it steps a plain torch optimizer itself): numbering
by optimizer steps alone would give all its saves one number.

Usage: accelerate_model_only.py LOCAL_ROOT OUT. A new process's view of the checkpoints an earlier one made:
``load_state()``, then one more ``save_state()``. Writes OUT (torch.save): the weights just loaded, the resume
point, and the folder the save went to. ``build`` is the job the tests make in their own process too.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from accelerate import Accelerator
from torch import nn

from accelerate_resilience import ResiliencePlugin, attach


def build() -> tuple[Accelerator, nn.Module]:
    """One process on CPU, a small model prepared alone."""
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Linear(4, 2))
    return accelerator, model


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def main() -> None:
    root, out = sys.argv[1], sys.argv[2]
    accelerator, model = build()
    attach(accelerator, ResiliencePlugin(local_root=root, keep_last=10))
    point = accelerator.load_state()
    loaded = weights(model)
    saved_to = accelerator.save_state()
    accelerator.end_training()  # waits for the save's commit
    torch.save({"weights": loaded, "resume": dataclasses.asdict(point), "saved_to": saved_to}, out)


if __name__ == "__main__":
    main()
