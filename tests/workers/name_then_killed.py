"""A training process that commits step 3, asks for its name (written by a helper from the step's lent staging
buffers, rank 0's way during ``fit()``) and waits to be killed while the name is being written.

    python name_then_killed.py <local_root> <name>
"""

from __future__ import annotations

import sys
import time

import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.formats.names import repaired_writer


def state() -> dict[str, torch.Tensor]:
    """What step 3 holds (the test makes it again to compare)."""
    generator = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300, 100, generator=generator), "b": torch.randn(7, generator=generator)}


if __name__ == "__main__":
    root, name = sys.argv[1:3]
    manager = CheckpointManager(CheckpointConfig(local_root=root, persist="process"))
    names = repaired_writer(manager)
    assert names is not None
    handle = manager.save(3, {"state_dict": state()}, extra={"adapter": "lightning"})
    assert handle is not None
    names.add(name, 3, ["state_dict"], handle, run_id=None)
    handle.committed.result()
    print("committed", flush=True)
    time.sleep(600)
