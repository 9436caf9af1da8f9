"""GPU utilization while a fit runs, read from NVML, for the windows a benchmark times.

What a save costs a GPU job is the time its GPU does not compute. ``nvmlDeviceGetUtilizationRates`` answers the
share of the last sample period (1/6 s to 1 s, by GPU) in which a kernel ran; a thread reads it every
``PERIOD_S`` with the time of the reading, and :func:`mean_within` averages the readings that fall in given
windows of the fit (the steady save intervals of ``bench_lightning --mode throughput``). Off a GPU, or without
nvidia-ml-py, nothing is read and the figures are None.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from resilience.health.nvml import default_devices, load_nvml

PERIOD_S = 0.05


class Utilization:
    """Reads the GPU's utilization every ``period_s`` while the ``with`` block runs: ``readings`` holds (the
    ``time.perf_counter()`` of the reading, percent)."""

    def __init__(self, active: bool, period_s: float = PERIOD_S, nvml: Any | None = None) -> None:
        self.readings: list[tuple[float, int]] = []
        self._period_s = period_s
        self._nvml = (nvml or load_nvml()) if active else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Utilization:
        if self._nvml is None:
            return self
        self._nvml.nvmlInit()
        device = default_devices()[0]
        by = self._nvml.nvmlDeviceGetHandleByIndex if isinstance(device, int) else self._nvml.nvmlDeviceGetHandleByUUID
        handle = by(device)
        self._thread = threading.Thread(target=self._read, args=(handle,), name="gpu-utilization", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        assert self._nvml is not None
        self._nvml.nvmlShutdown()

    def _read(self, handle: Any) -> None:
        assert self._nvml is not None
        while not self._stop.wait(self._period_s):
            self.readings.append((time.perf_counter(), self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu))


def mean_within(readings: list[tuple[float, int]], windows: Iterable[tuple[float, float]]) -> float | None:
    """The mean percent of the readings taken inside any of ``windows`` (start, end), or None if none was."""
    spans = list(windows)
    inside = [percent for at, percent in readings if any(start <= at < end for start, end in spans)]
    return statistics.fmean(inside) if inside else None
