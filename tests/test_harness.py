"""The test harness's own process handling: what the launcher tests rely on to leave nothing running."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.helpers import kill_job

# A launcher whose worker runs in a session of its own, as torchelastic starts its workers: killing the
# launcher's process group alone would leave the worker running.
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(worker.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_kill_job_takes_the_workers_in_sessions_of_their_own_too() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert launcher.stdout is not None
    worker = int(launcher.stdout.readline())
    assert os.getsid(worker) == worker != os.getsid(launcher.pid)
    kill_job(launcher)
    launcher.stdout.close()
    assert launcher.returncode == -9
    deadline = time.monotonic() + 10
    while not gone(worker):
        assert time.monotonic() < deadline, "the worker outlived kill_job"
        time.sleep(0.05)
