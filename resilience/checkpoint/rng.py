"""Random number generator state of one process: captured at save time, restored on resume.

Neither Lightning nor Accelerate saves all of it; without it a resumed run draws different dropout masks
and shuffles. Each rank has its own generators, so this is per-rank state.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# Set once this process's GPU had a fatal fault: its generators' state is on a device that must not be read.
DEVICE_UNREADABLE = False


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized() and not DEVICE_UNREADABLE:
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
