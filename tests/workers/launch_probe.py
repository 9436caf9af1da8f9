"""A rank under ``resilience launch`` that does, in each generation, what its test planned, and trains nothing.

PROBE_PLAN is JSON: ``{"<generation>:<rank>": action}``; a rank without an entry ends well. Actions: ``die:N`` (the
process ends with code N at once, as a crash would), ``late-die:N`` (the same, 1 s after the launcher's store is
open), ``fail`` (the script raises: the process stays and waits for the next generation), ``hang`` (sleeps, until
ended), ``evict:R`` (asks the launcher to end rank R, then fails), ``linger`` (ends well after 3 s), ``stop:N`` (an
agreed stop: ``sys.exit(N)``), ``sigterm`` (waits; SIGTERM makes it leave with 75, as a preempted rank does),
``store-after-first-step`` (prints a STORE line: whether the launcher's store listened 3 s after the start, and
once the rank said it is past its first step). Each generation prints one PROBE line (with the CPU priorities of
the thread that imported ``preload_probe``, where a spare preloaded it, and of the thread it started).
PROBE_RUNNING lists the generations (comma-separated) in which a rank says it is past its first step, as the
pack's session does at each step's end (its launcher then starts its spare).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from resilience.goodput.ledger import process_start_time
from resilience.recovery import inplace


def _pool_nice() -> int | None:
    """The CPU priority of the thread ``preload_probe`` started as it was imported, where a spare preloaded it."""
    probe = sys.modules.get("tests.workers.preload_probe")
    return None if probe is None else os.getpriority(os.PRIO_PROCESS, probe.POOL_THREAD)


rank, generation = int(os.environ["RANK"]), inplace.generation()
print(
    "PROBE "
    + json.dumps(
        {
            "rank": rank,
            "generation": generation,
            "pid": os.getpid(),
            "started": process_start_time(),
            "began": float(os.environ["RESILIENCE_GENERATION_BEGAN"]),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),  # this thread's: the one that runs the rank
            "preload_nice": getattr(sys.modules.get("tests.workers.preload_probe"), "NICE", None),
            "pool_nice": _pool_nice(),
        }
    ),
    flush=True,
)
if str(generation) in os.environ.get("PROBE_RUNNING", "").split(","):
    inplace.running()
action = json.loads(os.environ.get("PROBE_PLAN", "{}")).get(f"{generation}:{rank}", "ok")
kind, _, arg = action.partition(":")
if kind == "die":
    os._exit(int(arg))
elif kind == "late-die":
    inplace.store()  # once the launcher's store is open (node 0's launcher opens it after starting its ranks)
    time.sleep(1.0)
    os._exit(int(arg))
elif kind == "fail":
    raise RuntimeError(f"rank {rank} fails in generation {generation}")
elif kind == "linger":
    time.sleep(3.0)
elif kind == "hang":
    time.sleep(600)
elif kind == "evict":
    inplace.evict([int(arg)])
    raise RuntimeError(f"rank {arg} is hung")
elif kind == "stop":
    sys.exit(int(arg))
elif kind == "store-after-first-step":
    host, _, port = os.environ[inplace.ENV_STORE].rpartition(":")

    def listens() -> bool:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
        except OSError:
            return False
        return True

    time.sleep(3.0)  # the launcher would have opened its store in this time, but for the ranks' first step
    before = listens()
    inplace.running()
    deadline = time.monotonic() + 60
    while not listens() and time.monotonic() < deadline:
        time.sleep(0.1)
    print("STORE " + json.dumps({"rank": rank, "before": before, "after": listens()}), flush=True)
elif kind == "sigterm":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(75))
    print(f"READY {rank}", flush=True)
    time.sleep(600)
