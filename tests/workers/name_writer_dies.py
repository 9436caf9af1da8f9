"""Kills the helper process writing a Lightning name after its first tensor bytes are in the file, as a
kill -9 mid-write would, when ``TEST_KILL_NAME_WRITER=1``. Imported through ``RESILIENCE_HELPER_PRELOAD`` by
the helper forked to write the name."""

from __future__ import annotations

import os
import signal

from resilience.formats import torch_file

if os.environ.get("TEST_KILL_NAME_WRITER") == "1":
    original = torch_file._pwrite_all

    def write_then_die(fd: int, data: memoryview, offset: int) -> None:
        original(fd, data, offset)
        os.kill(os.getpid(), signal.SIGKILL)

    torch_file._pwrite_all = write_then_die
