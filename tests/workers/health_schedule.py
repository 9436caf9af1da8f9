"""One rank of a job with steps far shorter than the health check: the ranks must check at the same few
boundaries, and a stop signal that reaches the ranks at different steps must stop them at the same one.

Args: <steps> <step at which rank 0 is signalled> <step at which rank 1 is signalled>. Prints one RESULT line:
the step the ranks stopped at (or None) and how many agreements this rank ran.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch.distributed as dist

from resilience.dist import Channel
from resilience.health import HealthConfig, HealthGuard


def main() -> None:
    steps, *signalled_at = (int(a) for a in sys.argv[1:4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agreements = 0
    reduce = Channel.max

    def counted(channel: Channel, values: list[int]) -> list[int]:
        nonlocal agreements
        agreements += 1
        return reduce(channel, values)

    Channel.max = counted  # type: ignore[method-assign]
    guard = HealthGuard(HealthConfig(nvml=False, watchdog=False)).start()
    stopped = None
    for step in range(1, steps + 1):
        if step == signalled_at[rank]:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's signal reaches each process at its own moment
        if guard.on_step(step).stop:
            stopped = step
            break
    print("RESULT " + json.dumps({"stopped": stopped, "agreements": agreements}), flush=True)
    guard.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
