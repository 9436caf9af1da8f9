"""One rank of a job whose GPU fault on one rank must stop every rank at the same step, after a save.

Args: <checkpoint root>. The fault comes from RESILIENCE_INJECT. A non-daemon thread that never ends stands
for a stuck uploader or framework thread: the stop must still end the process, with the agreed exit code.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch
import torch.distributed as dist

from resilience import CheckpointConfig, CheckpointManager
from resilience.health import HealthConfig, HealthGuard


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    manager = CheckpointManager(CheckpointConfig(local_root=sys.argv[1]))
    # a short grace: the stuck thread below holds the process until the forced exit at its end
    config = HealthConfig(poll_interval_s=0.05, exit_timeout_s=1.0, watchdog=False, grace_s=4.0, exit_reserve_s=1.0)
    guard = HealthGuard(config).start()
    state = {"w": torch.arange(4.0)}
    for step in range(1, 11):
        decision = guard.on_step(step)
        if decision.stop:
            saved = guard.emergency_save(manager, step, state, rank_state={"rank": torch.tensor(rank)})
            report = {
                "step": decision.step,
                "severity": decision.severity.name,
                "source_rank": decision.source_rank,
                "exit_code": decision.exit_code,
                "reason": decision.reason,
                "local_committed": saved.local_committed,
                "fault_to_local_s": saved.fault_to_local_s,
            }
            print("RESULT " + json.dumps(report), flush=True)
            threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
            guard.stop()
    print("RESULT " + json.dumps({"step": None}), flush=True)


if __name__ == "__main__":
    main()
