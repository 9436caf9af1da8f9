"""A restore made as long as one from S3 on a fresh node, so that a test's signal can land in it.

With ``TEST_SLOW_LOAD_S`` set, every checkpoint read of the training process first adds its pid as a line to the
file ``TEST_LOADING_MARKER`` and waits that many seconds: before the read begins, or, with
``TEST_SLOW_LOAD_IN=shards``, as DCP opens each shard file, inside DCP's read (which catches every
``BaseException`` on each rank and hands them all back as one ``CheckpointException``). Imported by the test
workers before they build anything.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from contextlib import contextmanager

from resilience.checkpoint.restore import Restorer
from resilience.storage.dcp_fs import LoadFileSystem


def slow_down_loads_from_env() -> None:
    if not os.environ.get("TEST_SLOW_LOAD_S"):
        return
    seconds, marker = float(os.environ["TEST_SLOW_LOAD_S"]), os.environ["TEST_LOADING_MARKER"]

    def wait() -> None:
        with open(marker, "a") as lines:
            lines.write(f"{os.getpid()}\n")
        time.sleep(seconds)

    if os.environ.get("TEST_SLOW_LOAD_IN") == "shards":
        create_stream = LoadFileSystem.create_stream

        @contextmanager
        def slow_stream(self: LoadFileSystem, path: str, mode: str) -> Generator[object, None, None]:
            wait()
            with create_stream(self, path, mode) as stream:
                yield stream

        LoadFileSystem.create_stream = slow_stream  # type: ignore[method-assign,assignment]
        return
    load_entry = Restorer.load_entry

    def slow(self: Restorer, *args: object, **kwargs: object) -> object:
        wait()
        return load_entry(self, *args, **kwargs)  # type: ignore[arg-type]

    Restorer.load_entry = slow  # type: ignore[method-assign]
