"""One rank of a training run that is SIGKILLed at a random moment; launched by tests/test_reliability_fuzz.py.

Usage: reliability_fuzz.py train|resume LOCAL_ROOT DURABLE_URL TRACE_DIR

``train`` saves every step (state values derived from the step, as in engine_worker) until it is killed.
The plan in ``FUZZ_PLAN`` says whether this rank kills itself: when it enters ``phase`` for the
``occurrence``-th time it sends itself SIGKILL after ``delay_s`` (from a timer thread, so the phase goes on
meanwhile). With ``phase="timer"`` the kill comes from outside instead. Every phase entry and exit and every
commit the manager reports is appended to ``TRACE_DIR/rank-<R>.log`` with unbuffered writes, so the record
survives the kill and the test can tell what was in progress.

``resume`` loads the newest checkpoint on this many ranks, checks that it is exactly step
``TEST_EXPECT_STEP`` (``none``: nothing to resume), and saves the next step: training goes on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from resilience import CheckpointManager
from resilience import pipeline as pipeline_module
from resilience.pipeline import _RecordingWriter
from resilience.staging import HostStager
from resilience.storage import DurableTier, LocalTier
from tests.workers.engine_worker import check_restored, config, state_for

# Where a kill can be planned: the phases a save goes through, by the function that does each.
PHASES: dict[str, list[tuple[Any, str]]] = {
    "staging": [(HostStager, "stage")],
    "shards": [(_RecordingWriter, "write_data")],
    "dcp-metadata": [(_RecordingWriter, "finish")],
    "hash": [(pipeline_module, "hash_stream")],
    "manifest": [(LocalTier, "write_exclusive"), (DurableTier, "write_exclusive")],
    "upload": [(DurableTier, "put_file")],
    "retention": [(pipeline_module, "remove_checkpoint")],
}
MAX_STEPS = 60
STEP_S = 0.02  # the "compute" between saves


class Trace:
    """Append-only lines in a file; each one is a single write(2), complete or absent after a SIGKILL."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, *words: object) -> None:
        os.write(self._fd, (" ".join(map(str, words)) + "\n").encode())


def die_after(trace: Trace, delay_s: float, why: str) -> None:
    trace("kill", why, f"{delay_s:.4f}")
    if delay_s <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()


def instrument(trace: Trace, plan: dict[str, Any], rank: int) -> None:
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    armed = plan["phase"] in PHASES and plan["rank"] == rank

    def wrap(phase: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            with lock:
                counts[phase] += 1
                n = counts[phase]
            trace("enter", phase, n)
            if armed and phase == plan["phase"] and n == plan["occurrence"]:
                die_after(trace, plan["delay_s"], f"{phase}#{n}")
            try:
                return original(*args, **kwargs)
            finally:
                trace("exit", phase, n)

        return traced

    for phase, places in PHASES.items():
        for owner, name in places:
            setattr(owner, name, wrap(phase, getattr(owner, name)))


def main() -> None:
    mode, args, trace_dir = sys.argv[1], sys.argv[2:4], Path(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None

    if mode == "train":
        plan = json.loads(os.environ["FUZZ_PLAN"])
        trace = Trace(trace_dir, rank)
        instrument(trace, plan, rank)

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
