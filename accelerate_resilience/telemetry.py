"""Checkpoint events into the user's Accelerate trackers (TensorBoard, W&B, any ``GeneralTracker``).

The engine reports from its writer and uploader threads; tracker clients are not thread-safe and
``accelerator.log`` belongs to the training loop, so events wait in a queue until the training thread flushes
them (at every batch and save). They are logged at the current training step, not at the checkpoint's step:
commits arrive a few steps late and trackers such as W&B drop values logged at a step already passed.
"""

from __future__ import annotations

import queue
from typing import Any

from accelerate import Accelerator

PREFIX = "checkpoint"
_ENVELOPE = ("event", "step", "rank", "time")


def metrics(record: dict[str, Any]) -> dict[str, Any]:
    """``{"event": "local_commit", "step": 8, "write_s": 0.4}`` -> ``{"checkpoint/local_commit/step": 8, ...}``."""
    event = record["event"]
    values: dict[str, Any] = {f"{PREFIX}/{event}/step": record["step"]}
    for name, value in record.items():
        if name not in _ENVELOPE and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            values[f"{PREFIX}/{event}/{name}"] = value
    return values


class TrackerBridge:
    """Collects engine events from any thread; :meth:`flush` logs them from the training thread."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self._events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def put(self, record: dict[str, Any]) -> None:
        self._events.put(record)

    def flush(self, step: int) -> None:
        while True:
            try:
                record = self._events.get_nowait()
            except queue.Empty:
                return
            if self.accelerator.trackers:
                self.accelerator.log(metrics(record), step=step)
