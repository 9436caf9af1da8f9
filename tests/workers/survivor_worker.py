"""A small gloo training loop on the engine's TrainingSession, for the fault-model tests (tests/test_survivors.py).

Usage: survivor_worker.py SCENARIO ROOT. Every step does what DDP does: a gradient all-reduce on the default
group, then an optimizer step; the session's boundary follows. Per-rank state differs per rank, so a lost
rank's own state can be told apart. Scenarios:

* ``train``: 12 steps, an interval save every 4, then exit 0 (the reference, and the resumed run).
* ``kill``: rank ``TEST_VICTIM`` SIGKILLs itself in step 7's all-reduce; the others must save step 6 among
  themselves and exit 75.
* ``stop``: the victim SIGSTOPs itself there instead; the others are stuck in the all-reduce until the hang
  watchdog (with its liveness check) has them save and exit.
* ``midsave``: like ``kill``, but every background write waits 3 s first (``tests/workers/helper_faults.py``) and
  nobody waits for a save: the victim dies while step 4's save is in flight, which must never commit.
* ``unpublished``: like ``kill``, but the victim dies before its state of step 6 (RNG, marks) was written: the
  survivors commit step 6 without it.
* ``sick``: a drill injects XID 79 on the victim at step 6 (``RESILIENCE_INJECT``): every rank saves step 6, the
  victim's GPU unread, and exits 69.
* ``sharded``: the same with part of the state an FSDP-style shard that only its rank holds: the save stands
  down and the ranks exit 69 without committing.

``resume`` loads the newest checkpoint, prints what it holds and trains on to step 12. With ``TEST_ABORT=1`` the
survivors take the process group for NCCL's, and abort every group before they save, as they do on a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint.rng import capture_rng
from resilience.goodput import IntervalConfig
from resilience.health import HealthConfig
from resilience.recovery import peer_loss
from resilience.recovery.peer_loss import PeerLossConfig
from resilience.session import SaveState, TrainingSession
from tests.workers.victim import die_after_boundary

STEPS = 12


def wait_for_file(path: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def main() -> None:
    scenario, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if scenario == "midsave":
        os.environ.update(
            RESILIENCE_HELPER_PRELOAD="tests.workers.helper_faults",
            TEST_HELPER_FAULT="slow_write",
            TEST_SLOW_WRITE_S="3",
        )
    if os.environ.get("TEST_ABORT") == "1":
        peer_loss.nccl_in_use = lambda: True
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = int(os.environ.get("TEST_VICTIM", "1"))
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(256))
    optimizer = torch.optim.SGD([weight], lr=0.5, momentum=0.9)
    mesh = init_device_mesh("cpu", (world,))
    # an FSDP-style shard: each rank holds its own part, and nobody else does
    shard = distribute_tensor(torch.arange(8.0 * world), mesh, [Shard(0)]) if scenario == "sharded" else None
    torch.manual_seed(100 + rank)  # each rank's own stream, saved per rank
    marks = {"mark": torch.tensor([rank])}

    def build(step: int) -> SaveState:
        shared: dict[str, object] = {"model": {"w": weight}, "optim": optimizer.state_dict()}
        if shard is not None:
            shared["shard"] = shard
        return SaveState(shared, {"rng": capture_rng(), "marks": {"mark": marks["mark"].clone()}}, {"step": step})

    manager = CheckpointManager(CheckpointConfig(root, keep_last=3, collective_timeout_s=60))
    session = TrainingSession(manager, build)
    session.use_interval(IntervalConfig(every_n_steps=4))
    session.use_peer_loss(PeerLossConfig(stale_s=3.0, heartbeat_s=0.5, grace_s=60))
    if scenario in ("stop", "sick", "sharded"):
        session.use_health(HealthConfig(nvml=scenario != "stop", hang_min_s=4.0, hang_min_samples=3, grace_s=60))
    step = 0
    if scenario == "resume":
        restored = session.restore({"model": {"w": weight}})
        assert restored is not None
        optimizer.load_state_dict(restored.state["optim"])
        step = restored.step
        session.restored(restored)
        own = restored.rank_state  # None: lost before its state of that step was written ("unpublished")
        if own is not None:
            marks["mark"] = own["marks"]["mark"].clone()
        print("RESUMED", json.dumps({"step": step, "mark": int(marks["mark"]), "own": own is not None}), flush=True)
    session.start(step)
    if scenario == "unpublished" and rank == victim:  # its heartbeat thread never gets to write step 6's state
        assert session.peer_watch is not None
        liveness = session.peer_watch.liveness
        publish = liveness.publish
        liveness.publish = lambda at, state: publish(at, state) if at < 6 else None  # type: ignore[method-assign]
    try:
        while step < STEPS:
            session.step_begin(step)
            time.sleep(0.05)  # the forward pass
            if scenario == "midsave" and step == 6 and rank == victim:
                wait_for_file(os.path.join(root, "writing-4"))  # its helper is writing step 4
            if scenario in ("kill", "stop", "midsave") and step == 6 and rank == victim:
                die_after_boundary(session, step, signal.SIGSTOP if scenario == "stop" else signal.SIGKILL)
            if scenario == "unpublished" and step == 6 and rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            noise = torch.randn(256)  # this rank's stream: a wrongly restored RNG shows in the weights
            grad = noise + weight.detach()
            dist.all_reduce(grad)  # DDP's gradient all-reduce: where a lost peer shows
            weight.grad = grad / world
            optimizer.step()
            marks["mark"] += world
            step += 1
            boundary = session.step_end(step)
            if boundary.stop is not None:
                session.exit()
            if boundary.saved is not None and scenario != "midsave":
                session.wait()  # steps here are milliseconds; a real one outlasts the save's background half
    except RuntimeError as exc:
        session.on_failure(exc)  # a lost peer: saves among the survivors and exits 75
        raise
    session.end()
    if rank == 0:
        torch.save({"w": weight.detach().clone(), "step": step}, os.path.join(root, "final.pt"))
    print("DONE", json.dumps({"rank": rank, "mark": int(marks["mark"]), "w0": float(weight[0])}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
