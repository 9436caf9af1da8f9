"""Imported by the checkpoint helper process (``RESILIENCE_HELPER_PRELOAD``) to plant a fault where the persist
path really runs, chosen by ``TEST_HELPER_FAULT``:

* ``fail_write``: the DCP shard write of rank ``TEST_FAIL_RANK`` fails with a full disk;
* ``stall_manifest``: the local manifest write leaves the file ``TEST_READY_FILE`` and hangs, so a test can
  kill a process between the shard writes and the commit;
* ``slow_write``: every write first leaves a ``writing-<step>`` file in the local root and waits
  ``TEST_SLOW_WRITE_S``, so a signal can land mid-save;
* ``gated_write``: the write of step N waits until the file ``open-<N>`` exists in the folder ``TEST_WRITE_GATE``
  (at most 20 s), so a test sees what a save call left before its step is written.
"""

from __future__ import annotations

import os
import time

from resilience.persist import pipeline
from resilience.storage.tiers import LocalTier

_FAULT = os.environ.get("TEST_HELPER_FAULT")

if _FAULT == "fail_write":
    _write_data = pipeline.RecordingWriter.write_data

    def _failing(self: pipeline.RecordingWriter, plan: object, planner: object) -> object:
        if os.environ.get("RANK", "0") == os.environ.get("TEST_FAIL_RANK", "0"):
            raise OSError(28, "No space left on device")
        return _write_data(self, plan, planner)

    pipeline.RecordingWriter.write_data = _failing  # type: ignore[method-assign]

elif _FAULT == "stall_manifest":

    def _stall(self: LocalTier, path: str, data: bytes, *, fsync: bool = True) -> None:
        open(os.environ["TEST_READY_FILE"], "w").close()
        time.sleep(600)

    LocalTier.write_exclusive = _stall  # type: ignore[method-assign]

elif _FAULT == "slow_write":
    _write = pipeline.Pipeline._write

    def _slow(self: pipeline.Pipeline, job: pipeline.WriteJob) -> None:
        open(os.path.join(self.local.root, f"writing-{job.step}"), "w").close()
        time.sleep(float(os.environ["TEST_SLOW_WRITE_S"]))
        _write(self, job)

    pipeline.Pipeline._write = _slow  # type: ignore[method-assign]

elif _FAULT == "gated_write":
    _ungated = pipeline.Pipeline._write

    def _gated(self: pipeline.Pipeline, job: pipeline.WriteJob) -> None:
        gate, deadline = os.path.join(os.environ["TEST_WRITE_GATE"], f"open-{job.step}"), time.monotonic() + 20
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        _ungated(self, job)

    pipeline.Pipeline._write = _gated  # type: ignore[method-assign]
