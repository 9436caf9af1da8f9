"""Engine demo: train a small model, checkpoint asynchronously every few steps, then resume from the newest."""

from __future__ import annotations

import tempfile

import torch

from resilience import CheckpointConfig, CheckpointManager


def main() -> None:
    root = tempfile.mkdtemp(prefix="resilience-demo-")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with CheckpointManager(CheckpointConfig(root, keep_last=2)) as manager:
        for step in range(1, 31):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 10 == 0:
                handle = manager.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
                print(f"step {step}: save blocked {handle.timings['block_s'] * 1e3:.1f} ms")
    with CheckpointManager(CheckpointConfig(root, keep_last=2)) as manager:
        restored = manager.load()
        assert restored is not None
        print(f"resumed from step {restored.step} ({restored.tier} tier, {restored.manifest.total_bytes} bytes)")


if __name__ == "__main__":
    main()
