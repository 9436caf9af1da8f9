"""Kills the helper process writing a Lightning name after its first tensor bytes are in the file, as a
kill -9 mid-write would, when ``TEST_KILL_NAME_WRITER=1``. Imported through ``RESILIENCE_HELPER_PRELOAD`` by
the helper forked to write the name."""

from __future__ import annotations

import os
import signal
from typing import Any

from resilience.formats import torch_file

if os.environ.get("TEST_KILL_NAME_WRITER") == "1":
    # a record's bytes are written from memory, or copied from the shard: either way, die after the first
    write, copy = torch_file._pwrite_all, torch_file.copy_range

    def write_then_die(*args: Any) -> None:
        write(*args)
        os.kill(os.getpid(), signal.SIGKILL)

    def copy_then_die(*args: Any) -> None:
        copy(*args)
        os.kill(os.getpid(), signal.SIGKILL)

    torch_file._pwrite_all, torch_file.copy_range = write_then_die, copy_then_die
