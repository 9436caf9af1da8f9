"""Fault drills for the helper process writing a Lightning name, imported through ``RESILIENCE_HELPER_PRELOAD``
by every helper (the rank's own, which writes names, and any forked for one), chosen by ``TEST_NAME_WRITER_DRILL``:

- ``die``: kill itself after the first bytes of a record are in the file, as a kill -9 mid-write would;
- ``die-once:<file>``: the same in the first helper to write a record (it creates ``<file>``), not in later ones;
- ``pid:<file>``: write to ``<file>`` the pid of the process writing a name's records (at each), and go on;
- ``hang:<file>``: after the first record written from memory (a name made from its step's lent staging
  buffers), write its pid to ``<file>`` and hang, so that a test can kill the training process then. A record
  read back from the step's shards is an error here: the drill is of a name written from memory.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from resilience.formats import torch_file

DRILL = os.environ.get("TEST_NAME_WRITER_DRILL", "")


def _first(marker: str) -> bool:
    """Whether this is the first process to ask (it creates ``marker``)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _write_pid(path: str) -> None:
    with open(f"{path}.tmp", "w") as stream:
        stream.write(str(os.getpid()))
    os.replace(f"{path}.tmp", path)


if DRILL == "die" or DRILL.startswith("die-once:"):
    # a record's bytes are written from memory, or copied from the shard: either way, die after the first
    write, copy = torch_file.pwrite_all, torch_file.copy_range
    marker = DRILL.removeprefix("die-once:")

    def _die() -> None:
        if DRILL == "die" or _first(marker):
            os.kill(os.getpid(), signal.SIGKILL)

    def write_then_die(*args: Any) -> None:
        write(*args)
        _die()

    def copy_then_die(*args: Any) -> None:
        copy(*args)
        _die()

    torch_file.pwrite_all, torch_file.copy_range = write_then_die, copy_then_die

elif DRILL.startswith("pid:"):
    begin = torch_file._RecordWriter.write

    def write_and_tell(self: Any, *args: Any) -> None:
        _write_pid(DRILL.removeprefix("pid:"))
        begin(self, *args)

    torch_file._RecordWriter.write = write_and_tell

elif DRILL.startswith("hang:"):
    pid_file = DRILL.removeprefix("hang:")
    write_record = torch_file._RecordWriter.write

    def write_then_hang(self: Any, *args: Any) -> None:
        write_record(self, *args)
        _write_pid(pid_file)
        while True:
            time.sleep(1)

    def refuse_copy(self: Any, *args: Any) -> None:
        raise AssertionError("the name was read back from its step's shards, not written from the lent buffers")

    torch_file._RecordWriter.write, torch_file._RecordWriter.copy = write_then_hang, refuse_copy
