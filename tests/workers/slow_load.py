"""A restore made as long as one from S3 on a fresh node, so that a test's signal can land in it.

With ``TEST_SLOW_LOAD_S`` set, every checkpoint read of the training process first adds its pid as a line to the
file ``TEST_LOADING_MARKER`` and waits that many seconds. Imported by the test workers before they build anything.
"""

from __future__ import annotations

import os
import time

from resilience.checkpoint.restore import Restorer


def slow_down_loads_from_env() -> None:
    if not os.environ.get("TEST_SLOW_LOAD_S"):
        return
    seconds, marker = float(os.environ["TEST_SLOW_LOAD_S"]), os.environ["TEST_LOADING_MARKER"]
    load_entry = Restorer.load_entry

    def slow(self: Restorer, *args: object, **kwargs: object) -> object:
        with open(marker, "a") as lines:
            lines.write(f"{os.getpid()}\n")
        time.sleep(seconds)
        return load_entry(self, *args, **kwargs)  # type: ignore[arg-type]

    Restorer.load_entry = slow  # type: ignore[method-assign]
