"""One job of a pair sharing a durable URL by mistake; launched by tests/test_shared_storage.py.

Usage: shared_storage_worker.py MODE LOCAL_ROOT DURABLE_URL

* ``race``: wait until ``TEST_GO_FILE`` exists (both jobs are started first, so neither has uploaded), then
  claim and save ``TEST_STEPS`` (each committed durably before the next). Prints ``SAVED <run id>``, or
  ``REFUSED <error>`` and exits 3 when the engine stops this job.
* ``hold``: save ``TEST_STEPS`` durably, print ``HELD <run id>``, wait until ``TEST_HOLD_FILE`` exists, then save
  ``TEST_MORE_STEPS``: prints ``SAVED`` or ``REFUSED <error>`` (exit 3).

``TEST_MACHINE`` makes the job believe it runs on a machine of that name (its pid cannot be looked up from the
other job, which must then watch its beat); ``TEST_BEAT_S``/``TEST_WATCH_S`` shorten the beat and the watch.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from resilience import CheckpointConfig, CheckpointError, CheckpointManager, ConfigError
from resilience.recovery import beats
from resilience.storage import owners


def state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 64, generator=gen)}, "step": step}


def steps(name: str) -> list[int]:
    return [int(s) for s in os.environ[name].split(",") if s]


def wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.01)


def save_all(manager: CheckpointManager, wanted: list[int]) -> None:
    for step in wanted:
        manager.save(step, state(step))
        manager.wait(durable=True)


def main() -> None:
    mode, local, durable = sys.argv[1:4]
    if "TEST_MACHINE" in os.environ:
        owners.machine_id = lambda: os.environ["TEST_MACHINE"]  # type: ignore[assignment]
    beats.BEAT_S = float(os.environ.get("TEST_BEAT_S", beats.BEAT_S))
    beats.WATCH_S = float(os.environ.get("TEST_WATCH_S", beats.WATCH_S))
    options = json.loads(os.environ.get("TEST_STORAGE_OPTIONS", "{}"))
    config = CheckpointConfig(local, durable_url=durable, storage_options=options, keep_last=2)
    if mode == "race":
        wait_for(os.environ["TEST_GO_FILE"])
    manager = CheckpointManager(config)
    try:
        run_id = manager.claim()
        save_all(manager, steps("TEST_STEPS"))
        if mode == "hold":
            print("HELD", run_id, flush=True)
            wait_for(os.environ["TEST_HOLD_FILE"])
            save_all(manager, steps("TEST_MORE_STEPS"))
        manager.close()
    except (ConfigError, CheckpointError) as exc:
        print("REFUSED", exc, flush=True)
        manager.abandon()
        sys.exit(3)
    print("SAVED", run_id, flush=True)


if __name__ == "__main__":
    main()
