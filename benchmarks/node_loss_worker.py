"""One rank of bench_node_loss's two-node torchrun job (one rank per node, each node with a local root of its own).

Usage: node_loss_worker.py LOCAL_ROOT DURABLE_URL OUT_DIR SIZE_BYTES

With nothing to resume it saves step 1 of a replicated state of SIZE_BYTES (16 fp32 tensors, seeded values),
waits for its durable commit and then trains on (an all-reduce every 0.2 s) until a peer is lost or torchrun
restarts it; under ``resilience launch`` the survivor then runs this script again in its process. With
a checkpoint it loads it, checks every value bit-exact, runs one step's all-reduce, and writes
``OUT_DIR/<pid>.json``: when the load and the first step ended, the load's parts and where it read its bytes.
Settings come from the environment: ``BENCH_PEER_COPIES`` (1/0) and ``BENCH_STORAGE_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from resilience import CheckpointConfig, CheckpointManager

COUNT = 16


def state(size: int, seed: int | None) -> dict[str, torch.Tensor]:
    """The state: seeded values, or zeros for a load to overwrite."""
    numel = size // 4 // COUNT
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    make = (lambda: torch.randn(numel, generator=generator)) if generator else (lambda: torch.zeros(numel))
    return {f"t{i:02d}": make() for i in range(COUNT)}


def main() -> None:
    root, durable, out, size = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = CheckpointConfig(
        root,
        durable_url=durable,
        storage_options=json.loads(os.environ.get("BENCH_STORAGE_OPTIONS", "{}")),
        local_shared=False,
        peer_copies=os.environ.get("BENCH_PEER_COPIES") == "1",
        collective_timeout_s=300,
    )
    manager = CheckpointManager(config)
    target = state(size, None)
    began = time.time()
    restored = manager.load(target)
    loaded = time.time()
    if restored is None:
        manager.save(1, state(size, 0))
        manager.wait(durable=True)
        (out / f"saved-{rank}").write_text(root)
        while True:  # training on: a step's all-reduce fails once a peer is lost (or torchrun restarts this rank)
            dist.all_reduce(torch.ones(1))
            time.sleep(0.2)
    expected = state(size, 0)
    exact = all(torch.equal(target[k], expected[k]) for k in expected)
    dist.all_reduce(torch.ones(1))  # the first step's collective: every rank is back
    report = {
        "rank": rank,
        "root": root,
        "restored": restored.step,
        "exact": exact,
        "load_began": began,
        "loaded": loaded,
        "first_step": time.time(),
        "timings": restored.timings,
    }
    (out / f"{os.getpid()}.json").write_text(json.dumps(report))
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
