"""A node out of the job: its launcher cannot reach the job's store on node 0, or node 0 has declared it lost.

Either way the rest of the job goes on without this node (node 0's ranks save what their replicas hold), so
nothing here may commit or upload anything more: the ranks are ended (a SIGTERM, and a SIGKILL a few seconds
later for ranks stuck in a collective with the other side, which a signal cannot get out of), and the launcher
exits non-zero for its scheduler to see. Their state is not lost: the other side saved it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import NoReturn

log = logging.getLogger(__name__)
CUT_OFF_GRACE_S = 5.0  # how long a cut-off node's ranks get between SIGTERM and SIGKILL


def end_processes(procs: Iterable[subprocess.Popen[bytes]], grace_s: float) -> dict[int, int]:
    """SIGTERM every process, SIGKILL those alive ``grace_s`` later; their exit codes by pid."""
    procs = list(procs)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes: dict[int, int] = {}
    for proc in procs:
        try:
            codes[proc.pid] = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[proc.pid] = proc.wait()
    return codes


def leave_cut_off(why: str, procs: Iterable[subprocess.Popen[bytes]], code: int) -> NoReturn:
    """This node is out of the job (``why``): end its processes and the launcher, with ``code``. Safe from any
    thread: the main one may be blocked in a call that never returns."""
    log.error("%s: ending the ranks on this node and exiting %d (the rest of the job saves their state)", why, code)
    end_processes(procs, CUT_OFF_GRACE_S)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
