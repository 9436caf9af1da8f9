"""Two ranks through ``accelerate launch`` with automatic checkpoint naming: rank 0 writes each ``save_state()``'s
Accelerate folder, with every rank's RNG state; both ranks load a folder back on rank 0's word.

Usage: accelerate_folders.py PROJECT_DIR. Prints ``FOLDERS rank=R <json>``: the folders save_state() returned,
the step and save_iteration after ``load_state(<the first folder>)``, and a sum of the torch RNG state at the
last save.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.utils.data import DataLoader, TensorDataset

from accelerate_resilience import attach


def main() -> None:
    project = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True, total_limit=3)
    accelerator = Accelerator(cpu=True, project_config=project)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    resilience = attach(accelerator)
    torch.manual_seed(100 + accelerator.process_index)  # each rank's own stream, after DDP made the weights alike
    saved, rng = [], 0
    for step, (x, y) in enumerate(data):
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step in (1, 2):
            rng = int(torch.get_rng_state().sum())  # what the folder's random_states_<rank>.pkl must hold
            saved.append(accelerator.save_state())
    point = accelerator.load_state(saved[0])
    report = {"saved": saved, "step": point.global_step, "iteration": accelerator.save_iteration, "rng": rng}
    line = f"FOLDERS rank={accelerator.process_index} {json.dumps(report)}\n"
    os.write(1, line.encode())  # one write: the ranks share stdout, and print writes the newline apart
    resilience.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
