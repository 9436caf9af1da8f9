"""Refuses this node's uploads of step ``TEST_FAIL_UPLOAD_STEP``, as a bucket policy would (a permission error is
not retried), when ``TEST_FAIL_UPLOAD_HERE=1``. Imported by the training process and, through
``RESILIENCE_HELPER_PRELOAD``, by its checkpoint helper process, which is where uploads run."""

from __future__ import annotations

import os
from typing import Any

from resilience.storage.tiers import DurableTier


def fail_uploads(step: int) -> None:
    original = DurableTier.put_file

    def refuse(self: DurableTier, local_path: str, path: str, callback: Any = None) -> None:
        if f"/step-{step}/" in path:
            raise PermissionError(13, "Permission denied (injected on this node)", path)
        original(self, local_path, path, callback)

    DurableTier.put_file = refuse  # type: ignore[method-assign]


if os.environ.get("TEST_FAIL_UPLOAD_HERE") == "1":
    fail_uploads(int(os.environ["TEST_FAIL_UPLOAD_STEP"]))
