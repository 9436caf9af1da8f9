"""One rank of a training run that is SIGKILLed at a random moment; launched by tests/test_reliability_fuzz.py.

Usage: reliability_fuzz.py train|resume LOCAL_ROOT DURABLE_URL TRACE_DIR

``train`` saves every step (state values derived from the step, as in engine_worker) until it is killed.
The plan in ``FUZZ_PLAN`` says whether this rank dies at a phase of a save (tests/workers/fuzz_phases.py,
instrumenting this process and its checkpoint helper); with ``phase="timer"`` the kill comes from outside
instead. Every phase entry and exit and every commit the manager reports is appended to
``TRACE_DIR/rank-<R>.log`` with unbuffered writes, so the record survives the kill and the test can tell what
was in progress.

``resume`` loads the newest checkpoint on this many ranks, checks that it is exactly step
``TEST_EXPECT_STEP`` (``none``: nothing to resume), and saves the next step: training goes on.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from resilience import CheckpointManager
from tests.workers.engine_worker import check_restored, config, state_for

MAX_STEPS = 60
STEP_S = 0.02  # the "compute" between saves


def main() -> None:
    mode, args, trace_dir = sys.argv[1], sys.argv[2:4], Path(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None

    if mode == "train":
        # The phases of a save run in this rank's helper process, which imports the same instrumentation; a
        # kill planned there takes this process down with it: the whole rank dies at that phase.
        os.environ.update(FUZZ_TRACE_DIR=str(trace_dir), RESILIENCE_HELPER_PRELOAD="tests.workers.fuzz_phases")
        from tests.workers.fuzz_phases import Trace

        trace = Trace(trace_dir, rank)

        def note(event: dict[str, Any]) -> None:
            if event["event"] in ("local_commit", "durable_commit", "failed"):
                trace(event["event"], event["step"])

        manager = CheckpointManager(config(args), listeners=[note])
        trace("ready")
        for step in range(1, MAX_STEPS + 1):
            manager.save(step, state_for(step, mesh), {"rank": torch.tensor([rank * 1000 + step])})
            trace("saved", step)
            time.sleep(STEP_S)
        manager.close()  # the planned kill never came: the test reports a run that ends by itself

    else:
        want = os.environ["TEST_EXPECT_STEP"]
        with CheckpointManager(config(args)) as manager:
            target = state_for(0, mesh)
            restored = manager.load(target)
            if want == "none":
                assert restored is None, f"resumed step {restored.step} where nothing was committed"
                step = 1
            else:
                assert restored is not None, f"nothing resumed, expected step {want}"
                check_restored(restored, target, int(want), rank, mesh)
                step = restored.step + 1
            manager.save(step, state_for(step, mesh), {"rank": torch.tensor([rank * 1000 + step])})
            assert manager.wait(durable=True)
        print("RESUMED", want, restored.tier if restored else "-", "SAVED", step, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
