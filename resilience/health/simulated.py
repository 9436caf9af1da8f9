"""A stand-in for the ``pynvml`` module, for drills on machines without a driver and for tests.

It carries the real module's constants and exception classes, so the monitor catches exactly what it would
catch in production. Calls are answered, in order, by: a lost GPU (every call raises
``NVMLError_GpuIsLost``), an entry in ``answers``, a queued event (for the event-set wait), the real module
(in pass-through mode, when a driver is there), or the simulated healthy GPU, which supports the basics and
answers ``NVMLError_NotSupported`` to every query, like a GPU that lacks the feature.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

log = logging.getLogger(__name__)

# How long one slice of a real event wait lasts in pass-through mode, so queued faults are not held back
# behind a driver wait of a second.
_SLICE_S = 0.05


@dataclass(frozen=True)
class SimulatedDevice:
    """A device handle; any index or UUID asked for exists."""

    id: int | str


class SimulatedNVML:
    """Answers NVML calls for simulated (or, in pass-through mode, real) GPUs, with faults on demand.

    Args:
        module: The real ``pynvml`` module, for its constants and exception classes.
        passthrough: Forward unanswered calls to the real module when its ``nvmlInit`` succeeds; when it
            fails (no driver), fall back to the simulated GPU and say so once.
        device_count: What ``nvmlDeviceGetCount`` answers.

    Attributes:
        answers: Function name -> value to return, exception to raise, or callable taking the call's
            arguments. Set them to script a GPU's state.
        lost: Once True, every call raises ``NVMLError_GpuIsLost``.
    """

    def __init__(self, module: Any, *, passthrough: bool = False, device_count: int = 1):
        self.module = module
        self.passthrough = passthrough
        self.answers: dict[str, Any] = {}
        self._lost = False
        self._events: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._builtin: dict[str, Callable[..., Any]] = {
            "nvmlInit": self._init,
            "nvmlShutdown": self._shutdown,
            "nvmlDeviceGetCount": lambda: device_count,
            "nvmlDeviceGetHandleByIndex": SimulatedDevice,
            "nvmlDeviceGetHandleByUUID": SimulatedDevice,
            "nvmlEventSetCreate": object,
            "nvmlDeviceRegisterEvents": lambda handle, types, event_set: None,
            "nvmlEventSetFree": lambda event_set: None,
        }

    @property
    def lost(self) -> bool:
        return self._lost

    @lost.setter
    def lost(self, value: bool) -> None:
        with self._cond:
            self._lost = value
            self._cond.notify_all()

    def push_event(self, event_type: int, data: int = 0, device: Any = None) -> None:
        """Queue an event for the event-set wait; ``device`` None means the monitor's only GPU."""
        with self._cond:
            self._events.append(SimpleNamespace(device=device, eventType=event_type, eventData=data))
            self._cond.notify_all()

    def _error(self, code: int) -> Exception:
        """The module's exception for an NVML return code (``NVMLError(15)`` is an ``NVMLError_GpuIsLost``)."""
        return self.module.NVMLError(code)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.module, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            return lambda *args: self._call(name, *args)
        return value

    def _call(self, name: str, *args: Any) -> Any:
        if self._lost and name != "nvmlShutdown":
            raise self._error(self.module.NVML_ERROR_GPU_IS_LOST)
        if name in self.answers:
            answer = self.answers[name]
            if isinstance(answer, BaseException):
                raise answer
            return answer(*args) if callable(answer) else answer
        if name == "nvmlEventSetWait_v2":
            return self._wait(*args)
        if self.passthrough and name != "nvmlInit":
            return getattr(self.module, name)(*args)
        if name in self._builtin:
            return self._builtin[name](*args)
        raise self._error(self.module.NVML_ERROR_NOT_SUPPORTED)

    def _init(self) -> None:
        if not self.passthrough:
            return
        try:
            self.module.nvmlInit()
        except self.module.NVMLError as exc:
            self.passthrough = False
            log.warning("NVML is not available (%s): injected GPU faults go to a simulated GPU", exc)

    def _shutdown(self) -> None:
        """Only reached in simulation; pass-through shutdowns go to the real module."""

    def _wait(self, event_set: Any, timeout_ms: int) -> Any:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            with self._cond:
                if self._lost:
                    raise self._error(self.module.NVML_ERROR_GPU_IS_LOST)
                if self._events:
                    return self._events.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._error(self.module.NVML_ERROR_TIMEOUT)
                if not self.passthrough:
                    self._cond.wait(remaining)
                    continue
            try:
                return self.module.nvmlEventSetWait_v2(event_set, int(min(remaining, _SLICE_S) * 1000))
            except self.module.NVMLError_Timeout:
                continue
