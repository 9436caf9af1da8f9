"""One node's warm spares: processes started ahead, the script's libraries imported, each waiting for a rank.

A spare's interpreter and imports cost seconds of CPU. Started while the ranks themselves start or restart (their
own interpreter, imports and restore), it would take those seconds from them on a node with few cores. So a spare
starts once every rank of the node has said its first step of the generation is done (a file each, in
:attr:`Spares.marks`; see :func:`resilience.recovery.inplace.running`), or ``spare_delay_s`` after the ranks
(re)started when a rank never says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path

from resilience.recovery.inplace import running_mark

log = logging.getLogger(__name__)
MARKS_PREFIX = "resilience-launch-"


def _sweep_marks() -> None:
    """Remove the folders of marks that launchers killed outright left (``kill -9`` skips their own removal)."""
    for path in Path(tempfile.gettempdir()).glob(f"{MARKS_PREFIX}*-*"):
        pid = path.name[len(MARKS_PREFIX) :].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its launcher is gone (another user's live one raises PermissionError)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


class Spares:
    """The spares of one node's launcher.

    Args:
        count: How many to keep ready.
        delay_s: The longest wait, after the ranks (re)start, before the spares are started.
        command: A spare's command line.
        env: A spare's environment (called at each start).
    """

    def __init__(self, count: int, delay_s: float, command: list[str], env: Callable[[], dict[str, str]]):
        self.count, self.delay_s = count, delay_s
        self._command, self._env = command, env
        self.processes: list[subprocess.Popen[bytes]] = []
        _sweep_marks()
        self.marks = tempfile.mkdtemp(prefix=f"{MARKS_PREFIX}{os.getpid()}-")  # where ranks say they run (ENV_MARKS)
        self._due: float | None = None  # the spares are wanted from then on, or once the ranks run

    def ranks_started(self) -> None:
        """The node's ranks (re)started: the spares taken are started again once they run, or after the delay."""
        self._due = time.monotonic() + self.delay_s

    def look(self, generation: int, ranks: Collection[int], allowed: int) -> None:
        """Start the spares that are due, up to ``allowed`` (the restarts the job has left): ``ranks`` are this
        node's live ranks in ``generation``."""
        if self._due is None:
            return
        if self.ranks_run(generation, ranks) or time.monotonic() >= self._due:
            self._due = None
            while len(self.processes) < min(self.count, allowed):
                self.processes.append(subprocess.Popen(self._command, env=self._env(), stdin=subprocess.PIPE))

    def ranks_run(self, generation: int, ranks: Collection[int]) -> bool:
        """Whether each of ``ranks`` has said its first step of ``generation`` is done."""
        return all(os.path.exists(running_mark(self.marks, generation, rank)) for rank in ranks)

    def take(self) -> subprocess.Popen[bytes] | None:
        """A ready spare (removed from the set), or None."""
        while self.processes:
            spare = self.processes.pop(0)
            if spare.poll() is None:
                return spare
            log.warning("a spare process exited with code %s before it was needed", spare.returncode)
        return None

    def close(self) -> None:
        """End the spares not taken; remove the marks."""
        for spare in self.processes:
            with contextlib.suppress(OSError):
                spare.kill()
            spare.wait()
        self.processes.clear()
        shutil.rmtree(self.marks, ignore_errors=True)
