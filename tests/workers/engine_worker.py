"""One rank of a real gloo job exercising the checkpoint engine; launched by tests/test_engine_dist.py.

Usage: engine_worker.py SCENARIO LOCAL_ROOT [DURABLE_URL] — values are derived from the step, so a loader
on any number of ranks can check exactly what it got.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from resilience import CheckpointConfig, CheckpointError, CheckpointManager, Restored
from resilience.checkpoint import staging_area
from resilience.persist.pipeline import Pipeline

# Multiplies the rows of the two big tensors: TEST_STATE_SCALE=256 makes a checkpoint of about 2.6 MB.
SCALE = int(os.environ.get("TEST_STATE_SCALE", "1"))


def expected(step: int) -> dict[str, torch.Tensor]:
    """The full (unsharded) values of the state saved at ``step``."""
    gen = torch.Generator().manual_seed(step)
    return {
        "replicated": torch.randn(64 * SCALE, 32, generator=gen),
        "sharded": torch.randn(40 * SCALE, 16, generator=gen),
        "small": torch.arange(10, dtype=torch.int64) + step,
    }


def state_for(step: int, mesh: object | None) -> dict[str, object]:
    values = expected(step)
    sharded = values["sharded"]
    if mesh is not None:
        sharded = distribute_tensor(sharded, mesh, [Shard(0)])
    return {
        "model": {"replicated": values["replicated"], "sharded": sharded},
        "optim": {"state": {0: {"small": values["small"]}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "meta": {"step": step, "pair": (step, "x")},
    }


def check_restored(restored: Restored, target: dict[str, Any], want: int, rank: int, mesh: object | None) -> None:
    """Exactly the values saved at step ``want``, this rank's own per-rank state, DTensors filled in place."""
    assert restored.step == want, (restored.step, want)
    full = expected(want)
    model = restored.state["model"]
    assert torch.equal(model["replicated"], full["replicated"])
    sharded = model["sharded"]
    if mesh is not None:
        assert sharded is target["model"]["sharded"], "DTensor target must be filled in place"
        sharded = sharded.full_tensor()
    assert torch.equal(sharded, full["sharded"])
    assert torch.equal(restored.state["optim"]["state"][0]["small"], full["small"])
    assert restored.state["meta"] == {"step": want, "pair": (want, "x")}
    if rank < restored.manifest.world_size:
        assert int(restored.rank_state["rank"]) == rank * 1000 + want, restored.rank_state
    else:
        assert restored.rank_state is None


def config(args: list[str], **overrides: object) -> CheckpointConfig:
    durable = args[1] if len(args) > 1 and args[1] != "-" else None
    options = json.loads(os.environ.get("TEST_STORAGE_OPTIONS", "{}"))
    return CheckpointConfig(args[0], durable_url=durable, storage_options=options, keep_last=2, **overrides)


def main() -> None:
    scenario, args = sys.argv[1], sys.argv[2:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None

    if scenario == "save":
        steps = [int(s) for s in os.environ.get("TEST_STEPS", "1,2,3").split(",")]
        with CheckpointManager(config(args)) as manager:
            for step in steps:
                manager.save(step, state_for(step, mesh), {"rank": torch.tensor([rank * 1000 + step])})
            manager.wait(durable=manager.durable is not None)
        print("SAVED", json.dumps(manager.stats.block_s))

    elif scenario == "load":
        want = int(os.environ["TEST_EXPECT_STEP"])
        with CheckpointManager(config(args)) as manager:
            target = state_for(0, mesh)  # same structure, wrong values: the load must overwrite them
            restored = manager.load(target)
            assert restored is not None, "nothing restored"
            check_restored(restored, target, want, rank, mesh)
        print("LOADED", restored.step, restored.tier, restored.manifest.world_size)

    elif scenario == "rest":
        # Saves, rests (helpers ended, as at the end of a Lightning fit), saves again: every rank starts a new
        # helper, and they must form their group again through the store rank 0 already hosts.
        with CheckpointManager(config(args, persist="process")) as manager:
            manager.save(1, state_for(1, mesh), {"rank": torch.tensor([rank * 1000 + 1])})
            assert manager.rest()
            manager.save(2, state_for(2, mesh), {"rank": torch.tensor([rank * 1000 + 2])})
            manager.wait()
        print("RESTED", manager.stats.saves)

    elif scenario == "busy":
        # Rank 1's writer is slow; the skip decision must still be the same on both ranks.
        gate = threading.Event()
        original = Pipeline._write

        def slow_write(self: Pipeline, job: object) -> None:
            if rank == 1:
                gate.wait(30)
            original(self, job)

        Pipeline._write = slow_write  # type: ignore[method-assign]
        staging_area.MAX_SETS = 2  # a small state's two saves in flight hold every set of buffers
        with CheckpointManager(config(args, when_busy="skip", persist="thread")) as manager:
            first = manager.save(1, state_for(1, mesh))
            second = manager.save(2, state_for(2, mesh))  # a small state: its second set of buffers
            third = manager.save(3, state_for(3, mesh))  # both sets held on rank 1: skipped on both ranks
            gate.set()
            manager.wait()
            fourth = manager.save(4, state_for(4, mesh))
            manager.wait()
        assert None not in (first, second, fourth) and third is None, (first, second, third, fourth)
        print("BUSY", manager.stats.skipped)

    elif scenario == "fail":
        # Rank 1 cannot write its shard (in its helper process, where the write runs): no rank may commit, and
        # every rank must raise with context.
        os.environ.update(
            RESILIENCE_HELPER_PRELOAD="tests.workers.helper_faults", TEST_HELPER_FAULT="fail_write", TEST_FAIL_RANK="1"
        )
        manager = CheckpointManager(config(args))
        manager.save(1, state_for(1, mesh))
        try:
            manager.wait()
        except CheckpointError as exc:
            print("RAISED", exc)
        else:
            raise AssertionError("the failed save did not raise")
        manager.close()

    elif scenario == "name":
        # A Lightning name made on rank 0 from the save that wrote the step: rank 0's share of the tensors from
        # the buffers it staged them in, the rest (rank 1's) read back from rank 1's shards.
        from resilience.formats.names import NameWriter

        gen = torch.Generator().manual_seed(5)
        weights = {f"layer{i}": torch.randn(600, 500, generator=gen) for i in range(4)}
        weights["bias"] = torch.randn(9, generator=gen)
        lent: list[str] = []
        with CheckpointManager(config(args, persist=os.environ["TEST_PERSIST"])) as manager:
            handle = manager.save(1, {"state_dict": weights}, extra={"adapter": "lightning"})
            if rank == 0:

                def lend(saved: Any) -> Any:
                    loan = manager.lend_staged(saved)
                    lent.extend(loan.tensors if loan is not None else [])
                    return loan

                run = manager.call_off_process if os.environ["TEST_PERSIST"] == "process" else None
                names = NameWriter(manager.local, off_process=run, lend=lend)
                path = os.path.join(args[0], "..", "names", "step1.ckpt")
                names.add(path, 1, ["state_dict"], handle, run_id=None).result()
                loaded = torch.load(path, weights_only=True)["state_dict"]
                assert loaded.keys() == weights.keys(), loaded.keys()
                for key, value in weights.items():
                    assert torch.equal(loaded[key], value), key
                staged_here = [k for k in lent if k.startswith("state_dict/layer")]
                assert 0 < len(staged_here) < 4, lent  # both sources were used
                print("NAMED", len(staged_here))
            manager.wait()

    else:
        raise SystemExit(f"unknown scenario {scenario}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
