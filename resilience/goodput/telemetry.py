"""Per-save checkpoint figures from the manager's events, with GPU utilization during the save where NVML works.

The manager calls listeners from its writer and uploader threads, while loggers (Lightning's, Accelerate's
trackers) must be called from the training thread: the listener queues one metrics dict per event and the
adapter logs them with :meth:`CheckpointTelemetry.drain` at its next hook.

GPU utilization answers "does the background save slow the step?": NVML is sampled on a small thread into a
ring of timestamped readings, and each save takes the mean over its own time window once it is reported.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

from resilience.goodput.ledger import GoodputLedger

log = logging.getLogger(__name__)
PREFIX = "checkpoint/"
_STEP_NAMES = {"local_commit": "committed_step", "durable_commit": "uploaded_step"}
_COUNTED = {
    "failed": "failures",
    "skipped": "skipped",
    "upload_retry": "upload_retries",
    "storage_retry": "storage_retries",  # its ``count``: answers the storage client retried on its own
    "peer_copy_failed": "peer_copy_failures",
}


class GpuUtilSampler:
    """Samples one GPU's utilization (percent) in the background; None from :meth:`create` without NVML.

    Args:
        nvml: The ``pynvml`` module of nvidia-ml-py, or an object with its function names (a test's fake).
        handle: The NVML device handle.
        every_s: Sampling period; NVML itself averages over 1/6 s to 1 s.
        keep_s: How far back readings are kept (bounds memory; a longer save sees only its tail).
    """

    def __init__(self, nvml: Any, handle: Any, every_s: float = 0.2, keep_s: float = 3600.0) -> None:
        self._nvml = nvml
        self._handle = handle
        self.every_s = every_s
        self._readings: collections.deque[tuple[float, float]] = collections.deque(maxlen=int(keep_s / every_s) + 1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resilience-gpu-util", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, nvml: Any = None, index: int | None = None, every_s: float = 0.2) -> GpuUtilSampler | None:
        """Start sampling the GPU of this rank (``index``: NVML index; default from the environment)."""
        try:
            if nvml is None:
                import pynvml as nvml  # type: ignore[no-redef]
            nvml.nvmlInit()
            handle = _device_handle(nvml, index)
        except Exception as exc:  # no library, no driver, no GPU: the figures simply leave GPU use out
            log.debug("GPU utilization during saves is not sampled: %s: %s", type(exc).__name__, exc)
            return None
        return cls(nvml, handle, every_s)

    def mean(self, t0: float, t1: float) -> float | None:
        """Mean utilization over [t0, t1] (Unix time, ``t1`` about now).

        A reading describes the period before it, so the first one after ``t1`` counts too; a save shorter
        than the sampling period (or one the sampling thread slept through) takes a reading now.
        """
        with self._lock:
            values = [v for t, v in self._readings if t0 <= t <= t1 + self.every_s]
        if not values and (value := self._read()) is not None:
            values = [value]
        return sum(values) / len(values) if values else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s) and self._read() is not None:
            pass

    def _read(self) -> float | None:
        if self._stop.is_set():
            return None
        try:
            value = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception as exc:  # a lost GPU is the health monitor's business, not this sampler's
            log.debug("GPU utilization sampling stopped: %s: %s", type(exc).__name__, exc)
            self._stop.set()
            return None
        with self._lock:
            self._readings.append((time.time(), value))
        return value


def _device_handle(nvml: Any, index: int | None) -> Any:
    """NVML numbers GPUs physically and ignores CUDA_VISIBLE_DEVICES, so map this rank's visible device."""
    if index is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if local_rank < len(visible) and not visible[local_rank].isdigit():
            return nvml.nvmlDeviceGetHandleByUUID(visible[local_rank])
        index = int(visible[local_rank]) if local_rank < len(visible) else local_rank
    return nvml.nvmlDeviceGetHandleByIndex(index)


class CheckpointTelemetry:
    """A :class:`~resilience.CheckpointManager` listener turning its events into per-save metrics.

    Args:
        ledger: Also note saves, uploads and failures in the goodput ledger (for the report's timeline).
        sample_gpu: Sample GPU utilization with NVML when it is available.
        nvml: NVML module or fake (default: ``import pynvml``); see :class:`GpuUtilSampler`.
        gpu_index: NVML index of this rank's GPU (default: from LOCAL_RANK and CUDA_VISIBLE_DEVICES).
        gpu_every_s: GPU sampling period.
    """

    def __init__(
        self,
        *,
        ledger: GoodputLedger | None = None,
        sample_gpu: bool = True,
        nvml: Any = None,
        gpu_index: int | None = None,
        gpu_every_s: float = 0.2,
    ) -> None:
        self.ledger = ledger
        self.gpu = GpuUtilSampler.create(nvml, gpu_index, gpu_every_s) if sample_gpu else None
        self.records: list[dict[str, float]] = []
        self.counts = dict.fromkeys(_COUNTED.values(), 0)
        self._pending: collections.deque[dict[str, float]] = collections.deque()

    def __call__(self, event: dict[str, Any]) -> None:
        kind, step = event["event"], event["step"]
        metrics: dict[str, float] | None = None
        if kind == "local_commit":
            metrics = self._local(event)
        elif kind == "durable_commit":
            metrics = self._durable(event)
        elif kind == "peer_copy":  # this rank's files sent to the next node's memory (peer copies)
            metrics = {
                PREFIX + "peer_copy_s": float(event["seconds"]),
                PREFIX + "peer_copy_bytes": float(event["bytes"]),
            }
        elif kind in _COUNTED:
            name = _COUNTED[kind]
            self.counts[name] += int(event.get("count", 1))
            metrics = {PREFIX + name: float(self.counts[name])}
        if metrics is None:
            return
        if kind in _STEP_NAMES:  # one name per event, so a logger row never holds two values of one key
            metrics[PREFIX + _STEP_NAMES[kind]] = step
        self.records.append(metrics)
        self._pending.append(metrics)
        if self.ledger is not None:
            fields: dict[str, Any] = {name.removeprefix(PREFIX): value for name, value in metrics.items()}
            fields["step"] = step
            if kind == "failed":
                fields.update(tier=event.get("tier"), error=event.get("error"))
            self.ledger.note(f"save_{kind}", **fields)

    def drain(self) -> list[dict[str, float]]:
        """Metrics dicts queued since the last call, oldest first (call from the training thread)."""
        out = []
        while self._pending:
            out.append(self._pending.popleft())
        return out

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()

    def _local(self, event: dict[str, Any]) -> dict[str, float]:
        timings = {name: float(event.get(name, 0.0)) for name in ("block_s", "stage_wait_s", "write_s", "hash_s")}
        nbytes = float(event.get("bytes", 0))
        metrics = {PREFIX + name: value for name, value in timings.items()}
        metrics[PREFIX + "bytes"] = nbytes
        if timings["write_s"] > 0:
            metrics[PREFIX + "write_MBps"] = nbytes / timings["write_s"] / 1e6
        self._gpu_mean(metrics, "gpu_util_save_pct", event["time"] - sum(timings.values()), event["time"])
        return metrics

    def _durable(self, event: dict[str, Any]) -> dict[str, float]:
        upload_s, nbytes = float(event.get("upload_s", 0.0)), float(event.get("bytes", 0))
        metrics = {PREFIX + "upload_s": upload_s, PREFIX + "upload_bytes": nbytes}
        if upload_s > 0:
            metrics[PREFIX + "upload_MBps"] = nbytes / upload_s / 1e6
        self._gpu_mean(metrics, "gpu_util_upload_pct", event["time"] - upload_s, event["time"])
        return metrics

    def _gpu_mean(self, metrics: dict[str, float], name: str, t0: float, t1: float) -> None:
        if self.gpu is not None and (value := self.gpu.mean(t0, t1)) is not None:
            metrics[PREFIX + name] = value
