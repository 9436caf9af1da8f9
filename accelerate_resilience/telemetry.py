"""The handle's figures into the user's Accelerate trackers (TensorBoard, W&B, any ``GeneralTracker``).

Per-save checkpoint figures come from the engine's :class:`~resilience.goodput.CheckpointTelemetry`, which
the manager calls from its writer and uploader threads; tracker clients are not thread-safe and
``accelerator.log`` belongs to the training loop, so they wait in its queue until the training thread flushes
them (at every batch and save). Everything is logged at the current training step, not at the checkpoint's
step: commits arrive a few steps late and trackers such as W&B drop values logged at a step already passed.
"""

from __future__ import annotations

from accelerate import Accelerator

from resilience.goodput import CheckpointTelemetry, GoodputLedger
from resilience.pipeline import Listener


class TrackerBridge:
    """Queues checkpoint figures on the main process (the only one whose ``accelerator.log`` logs)."""

    def __init__(self, accelerator: Accelerator, ledger: GoodputLedger):
        self.accelerator = accelerator
        self.checkpoints: CheckpointTelemetry | None = None
        if accelerator.is_main_process:
            # NVML would report another GPU (or none) for a CPU run on a GPU machine.
            self.checkpoints = CheckpointTelemetry(ledger=ledger, sample_gpu=accelerator.device.type == "cuda")

    @property
    def listeners(self) -> list[Listener]:
        return [self.checkpoints] if self.checkpoints is not None else []

    def flush(self, step: int) -> None:
        if self.checkpoints is not None:
            for metrics in self.checkpoints.drain():
                self.log(metrics, step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.accelerator.trackers:
            self.accelerator.log(metrics, step=step)

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.close()
