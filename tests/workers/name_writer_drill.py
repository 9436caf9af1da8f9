"""Fault drills for the helper process writing a Lightning name, imported through ``RESILIENCE_HELPER_PRELOAD``
by the helper forked to write it, chosen by ``TEST_NAME_WRITER_DRILL``:

- ``die``: kill itself after the first bytes of a record are in the file, as a kill -9 mid-write would;
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

if DRILL == "die":
    # a record's bytes are written from memory, or copied from the shard: either way, die after the first
    write, copy = torch_file.pwrite_all, torch_file.copy_range

    def write_then_die(*args: Any) -> None:
        write(*args)
        os.kill(os.getpid(), signal.SIGKILL)

    def copy_then_die(*args: Any) -> None:
        copy(*args)
        os.kill(os.getpid(), signal.SIGKILL)

    torch_file.pwrite_all, torch_file.copy_range = write_then_die, copy_then_die

elif DRILL.startswith("hang:"):
    pid_file = DRILL.removeprefix("hang:")
    write_record = torch_file._RecordWriter.write

    def write_then_hang(self: Any, *args: Any) -> None:
        write_record(self, *args)
        with open(f"{pid_file}.tmp", "w") as stream:
            stream.write(str(os.getpid()))
        os.replace(f"{pid_file}.tmp", pid_file)
        while True:
            time.sleep(1)

    def refuse_copy(self: Any, *args: Any) -> None:
        raise AssertionError("the name was read back from its step's shards, not written from the lent buffers")

    torch_file._RecordWriter.write, torch_file._RecordWriter.copy = write_then_hang, refuse_copy
