"""A rank under ``accelerate launch`` that says where its helpers were forked (tests/test_sibling_server.py).

Both ranks make their plugin (which starts or finds the node's fork server), each in a working directory
OUT_DIR/work<R> with its stdout there, and fork helpers; each writes OUT_DIR/rank<R>.json: its pid, its server's
pid, the pid of the process that forked its helper, and the helper's working directory and training process (a
helper also prints to stdout). Then rank 1 starts a call in a helper that holds until told, and rank 0,
the server's owner, kills itself with SIGKILL; rank 1 (which stays through the launcher's stop signal) lets its
call finish once that server is gone, forks one more helper, and adds what it saw to OUT_DIR/after.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def held(folder: str) -> tuple[int, int]:
    """Run in a helper: say so (``holding``), wait for ``release``; the helper's parent then, and at the start."""
    forked_by = os.getppid()
    Path(folder, "holding").touch()
    while not os.path.exists(os.path.join(folder, "release")):
        time.sleep(0.02)
    return forked_by, os.getppid()


def wait_for(ready: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert time.monotonic() < deadline, f"waited a minute for {what}"
        time.sleep(0.02)


def main(out: Path) -> None:
    from accelerate_resilience import ResiliencePlugin
    from resilience.persist import sibling_file
    from resilience.persist.fork_server import ForkServer
    from resilience.persist.helper import call_in_helper
    from resilience.storage.processes import process_start_ticks
    from tests.workers import sibling_ranks  # held() by its module's name: a helper cannot import __main__

    rank = int(os.environ["LOCAL_RANK"])
    work = out / f"work{rank}"  # each rank's own working directory and stdout (as a launcher's --tee gives)
    work.mkdir()
    os.chdir(work)
    os.dup2(os.open(work / "stdout", os.O_WRONLY | os.O_CREAT | os.O_APPEND), 1)
    ResiliencePlugin(local_root=str(out / "ckpt"), persist="process")  # as a training script makes it
    server = ForkServer.get()
    server_pid = server.process.pid if isinstance(server, ForkServer) else server.pid
    report = {
        "pid": os.getpid(),
        "server": server_pid,
        "forked_by": call_in_helper(os.getppid),
        "helper_cwd": call_in_helper(os.getcwd),
        "settings_of": int(call_in_helper(os.getenv, "RESILIENCE_HELPER_PARENT_PID")),
        "printed": call_in_helper(print, f"a helper of rank {rank}", flush=True),
        "published": sibling_file.sibling_path(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        wait_for(lambda: (out / "holding").exists(), "rank 1's helper to start its call")
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher stops this rank when rank 0 dies: it stays to check
    result: list[tuple[int, int]] = []
    call = threading.Thread(target=lambda: result.append(call_in_helper(sibling_ranks.held, str(out))))
    call.start()
    wait_for(lambda: process_start_ticks(server_pid) is None, "rank 0's server to end")
    (out / "release").touch()
    call.join(60)
    after = {"held": result[0], "forked_by": call_in_helper(os.getppid)}
    own = ForkServer.get()
    after["own_server"] = own.process.pid if isinstance(own, ForkServer) else -1
    (out / "after.json").write_text(json.dumps(after))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
