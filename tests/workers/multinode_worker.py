"""One rank of a two-node torchrun job on one host, each node with a local root of its own; launched by
tests/test_engine_multinode.py.

Usage: multinode_worker.py LOCAL_ROOT DURABLE_URL REPORT_DIR

With nothing to resume it saves the steps in ``TEST_STEPS``, waiting for each durable commit; with a checkpoint
it loads it, checks every value bit-exact (tests/workers/engine_worker.py derives the values from the step), and
saves the next step. Either way it then writes ``REPORT_DIR/<pid>.json``: what it restored, which shard files it
opened in which tier, its node as the engine sees it, the error each save raised. Node-specific settings are keyed
by local root, since torchrun may give a node other ranks after a restart: the uploads of step
``TEST_FAIL_UPLOAD_STEP`` fail on the node whose root is ``TEST_FAIL_UPLOAD_ROOT``; with ``TEST_PARK=1`` a run
that saved stays (as one that trains on) until it is killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from resilience import CheckpointError, CheckpointManager
from tests.helpers import record_tier_opens
from tests.workers.engine_worker import check_restored, config, state_for


def main() -> None:
    root, durable, reports = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    reads: list[tuple[str, str]] = []
    record_tier_opens(reads)
    report: dict[str, Any] = {"rank": rank, "root": root, "pid": os.getpid(), "restored": None, "errors": {}}
    if os.environ.get("TEST_FAIL_UPLOAD_ROOT") == root:  # before the manager starts its helper, which uploads
        os.environ.update(TEST_FAIL_UPLOAD_HERE="1", RESILIENCE_HELPER_PRELOAD="tests.workers.upload_faults")
        import tests.workers.upload_faults  # noqa: F401  (and in this process, for persist="thread")
    manager = CheckpointManager(config([root, durable], local_shared=False, collective_timeout_s=60))
    report.update(leader=manager.is_local_leader, node_ranks=manager.topology.ranks_on_my_node())
    target = state_for(0, mesh)  # the right structure with the wrong values: a load must overwrite them all
    restored = manager.load(target)
    if restored is not None:
        check_restored(restored, target, restored.step, rank, mesh)
        report.update(restored=restored.step, tier=restored.tier, reads=reads)
        steps = [restored.step + 1]
    else:
        steps = [int(s) for s in os.environ["TEST_STEPS"].split(",")]
    for step in steps:
        manager.save(step, state_for(step, mesh), {"rank": torch.tensor([rank * 1000 + step])})
        try:
            manager.wait(durable=True)
        except CheckpointError as exc:
            report["errors"][step] = str(exc)
    report.update(saved=steps, owners=sorted(p.name for p in (Path(root) / ".owners").glob("*.json")))
    partial = reports / f".{os.getpid()}.tmp"
    partial.write_text(json.dumps(report))
    partial.rename(reports / f"{os.getpid()}.json")
    if restored is None and os.environ.get("TEST_PARK") == "1":
        while True:  # training on; the agent's restart (or the node's loss) ends it
            time.sleep(1)
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
