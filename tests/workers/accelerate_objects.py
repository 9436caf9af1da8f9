"""Two ranks through ``accelerate launch``; only rank 1's registered object holds a value that only pickle can
store (a Fraction). Both ranks must get the refusal at their save_state() call, none waiting on the other.

Usage: accelerate_objects.py LOCAL_ROOT. Prints ``REFUSED rank=R <message>`` or ``SAVED rank=R``.
"""

from __future__ import annotations

import sys
from fractions import Fraction
from typing import Any

import torch
from accelerate import Accelerator

from accelerate_resilience import ResiliencePlugin, attach
from resilience.errors import ConfigError


class Progress:
    """Per-rank state: what a rank registered for checkpointing."""

    def __init__(self, value: Any):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def main() -> None:
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    rank = accelerator.process_index
    accelerator.register_for_checkpointing(Progress(Fraction(1, 3) if rank == 1 else 1 / 3))
    attach(accelerator, ResiliencePlugin(local_root=sys.argv[1]))
    try:
        accelerator.save_state()
    except ConfigError as exc:
        print(f"REFUSED rank={rank} {exc}", flush=True)
    else:
        print(f"SAVED rank={rank}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
