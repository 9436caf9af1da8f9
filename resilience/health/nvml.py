"""GPU health through NVML, watched from a daemon thread so the training thread never waits on the driver.

The monitor talks to an ``nvml`` object with the function names, constants and exception classes of the
``pynvml`` module from nvidia-ml-py. That object is the whole fault-injection boundary: production passes
the module itself, drills and tests pass a :class:`~resilience.health.simulated.SimulatedNVML`, and the
monitor code that runs is the same.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resilience.health.events import EventLog
from resilience.health.faults import FaultTable, Kind, Rule

log = logging.getLogger(__name__)

# Event types registered one by one: a driver that lacks one still delivers the others.
_EVENT_TYPES = ("nvmlEventTypeXidCriticalError", "nvmlEventTypeDoubleBitEccError", "nvmlEventTypeGpuUnavailableError")
# Clock-event reason bits that mean the hardware, not the user or the workload, slowed the GPU.
_SLOWDOWN_BITS = {
    "nvmlClocksEventReasonHwSlowdown": Kind.HW_SLOWDOWN,
    "nvmlClocksEventReasonHwThermalSlowdown": Kind.THERMAL_SLOWDOWN,
    "nvmlClocksEventReasonHwPowerBrakeSlowdown": Kind.POWER_BRAKE_SLOWDOWN,
}
# Which member of the field value's union holds the number, by its valueType.
_VALUE_MEMBERS = {
    "NVML_VALUE_TYPE_DOUBLE": "dVal",
    "NVML_VALUE_TYPE_UNSIGNED_INT": "uiVal",
    "NVML_VALUE_TYPE_UNSIGNED_LONG": "ulVal",
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": "ullVal",
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": "sllVal",
    "NVML_VALUE_TYPE_SIGNED_INT": "siVal",
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": "usVal",
}
_WAIT_S = 1.0


def load_nvml() -> Any | None:
    """The ``pynvml`` module of nvidia-ml-py, or None when it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def default_devices(env: Mapping[str, str] | None = None) -> list[int | str]:
    """The GPU this rank uses, as an NVML index or UUID: LOCAL_RANK's entry of CUDA_VISIBLE_DEVICES.

    A single visible device is taken whatever LOCAL_RANK is (schedulers that bind one GPU per task).
    Indices in CUDA_VISIBLE_DEVICES follow CUDA's order, which matches NVML's on nodes of identical GPUs
    or with CUDA_DEVICE_ORDER=PCI_BUS_ID; elsewhere pass ``devices`` (UUIDs are exact).
    """
    env = os.environ if env is None else env
    local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [local_rank]
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if not entries or entries[0].startswith("-"):
        return []
    entry = entries[0] if len(entries) == 1 else entries[local_rank] if local_rank < len(entries) else None
    if entry is None:
        log.warning("LOCAL_RANK=%d but CUDA_VISIBLE_DEVICES=%r: watching all visible GPUs", local_rank, visible)
        return [int(e) if e.isdigit() else e for e in entries]
    return [int(entry) if entry.isdigit() else entry]


@dataclass
class _Device:
    name: int | str
    handle: Any
    lost: bool = False


class HealthMonitor:
    """Reports GPU faults of the watched devices into an :class:`EventLog`.

    The thread waits on an NVML event set (XID, double-bit ECC, GPU unavailable) and every
    ``poll_interval_s`` reads the uncorrected ECC counter, remapped rows, retired pages, clock-event
    reasons and the recovery-action field. A call the GPU does not support is skipped from then on,
    quietly; ``NVMLError_GpuIsLost`` from any call is a lost GPU. Conditions (slowdown, pending remap)
    are reported when they appear and again only after they cleared; one-off faults once per device.

    Args:
        nvml: Object with the ``pynvml`` module's names; None means NVML is not installed.
        events: Where faults go.
        table: Severity of each fault.
        devices: NVML indices or UUIDs to watch.
        poll_interval_s: Seconds between counter reads.
    """

    def __init__(
        self,
        nvml: Any,
        events: EventLog,
        table: FaultTable,
        devices: Sequence[int | str],
        *,
        poll_interval_s: float = 5.0,
    ):
        self.nvml = nvml
        self.events = events
        self.table = table
        self.device_names = list(devices)
        self.poll_interval_s = poll_interval_s
        self.running = False
        self._devices: list[_Device] = []
        self._event_set: Any = None
        self._unsupported: set[tuple[int | str | None, str]] = set()
        self._warned: set[tuple[int | str | None, str]] = set()
        self._reported: set[tuple[Any, ...]] = set()
        self._ecc_baseline: dict[int | str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- start and stop ------------------------------------------------------------------------------------

    def start(self) -> bool:
        """Start watching; False (after one notice) when there is no NVML or no GPU to watch."""
        if self.nvml is None:
            return self._notice("nvidia-ml-py is not installed (pip install nvidia-ml-py)", node_wide=True)
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as exc:
            return self._notice(f"NVML is not available ({type(exc).__name__}: {exc})", node_wide=True)
        self._devices = [d for d in map(self._open, self.device_names) if d is not None]
        if not self._devices:
            self._shutdown_nvml()
            return self._notice(f"none of the GPUs {self.device_names} could be opened through NVML")
        self._event_set = self._register_events()
        self.running = True
        self._thread = threading.Thread(target=self._run, name="resilience-gpu-health", daemon=True)
        self._thread.start()
        log.info("watching GPU(s) %s through NVML", [d.name for d in self._devices])
        return True

    def close(self, timeout: float = 2 * _WAIT_S) -> None:
        if not self.running:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            if self._event_set is not None:
                self._call(None, "nvmlEventSetFree", self._event_set)
            self._shutdown_nvml()
        self.running = False

    def _notice(self, why: str, *, node_wide: bool = False) -> bool:
        """Say why GPU health is not watched: once per node when it holds for the whole node (no driver, no
        binding), so a job of many ranks prints one line per node, not one per rank."""
        first_on_node = int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
        where = "this node" if node_wide else f"rank {self.events.rank}"
        log.log(
            logging.WARNING if first_on_node or not node_wide else logging.DEBUG,
            "rank %d: %s; GPU health is not monitored on %s. Preemption signals and the hang watchdog still work.",
            self.events.rank,
            why,
            where,
        )
        return False

    def _shutdown_nvml(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)

    def _open(self, name: int | str) -> _Device | None:
        function = "nvmlDeviceGetHandleByIndex" if isinstance(name, int) else "nvmlDeviceGetHandleByUUID"
        try:
            return _Device(name, getattr(self.nvml, function)(name))
        except self.nvml.NVMLError as exc:
            log.warning("cannot open GPU %r through NVML (%s); it is not watched", name, exc)
            return None

    def _register_events(self) -> Any:
        event_set = self._call(None, "nvmlEventSetCreate")
        if event_set is None:
            return None
        registered = 0
        for device in self._devices:
            for type_name in _EVENT_TYPES:
                event_type = getattr(self.nvml, type_name, None)
                if event_type is None:
                    continue
                try:
                    self.nvml.nvmlDeviceRegisterEvents(device.handle, event_type, event_set)
                    registered += 1
                except self.nvml.NVMLError as exc:
                    log.debug("GPU %s: cannot register %s (%s)", device.name, type_name, exc)
        if registered:
            return event_set
        self._call(None, "nvmlEventSetFree", event_set)
        return None

    # ---- the thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_poll = 0.0
        while not self._stop.is_set():
            try:
                next_poll = self._cycle(next_poll)
            except Exception:
                # A monitor thread that dies quietly leaves a weeks-long job unwatched: say so, keep going.
                log.exception("rank %d: GPU health check failed; retrying", self.events.rank)
                self._stop.wait(self.poll_interval_s)

    def _cycle(self, next_poll: float) -> float:
        now = time.monotonic()
        if now >= next_poll:
            self._poll()
            next_poll = now + self.poll_interval_s
        timeout = max(0.0, min(_WAIT_S, next_poll - time.monotonic()))
        if self._event_set is None:
            self._stop.wait(timeout)
        else:
            self._wait_for_event(timeout)
        return next_poll

    def _wait_for_event(self, timeout: float) -> None:
        data = self._call(None, "nvmlEventSetWait_v2", self._event_set, int(timeout * 1000))
        if data is None:
            return
        device = self._event_device(data.device)
        if data.eventType & getattr(self.nvml, "nvmlEventTypeXidCriticalError", 0):
            xid = int(data.eventData)
            self._report(device, Kind.XID, self.table.xid(xid), f"XID {xid} on GPU {_name(device)}", tag=xid, xid=xid)
        elif data.eventType & getattr(self.nvml, "nvmlEventTypeDoubleBitEccError", 0):
            self._report_kind(device, Kind.ECC_DOUBLE_BIT, f"double-bit ECC event on GPU {_name(device)}")
        elif data.eventType & getattr(self.nvml, "nvmlEventTypeGpuUnavailableError", 0):
            self._lost(device)

    def _event_device(self, handle: Any) -> _Device | None:
        """The watched device an event came from; the only one when the handle does not say."""
        key = _handle_key(handle)
        for device in self._devices:
            if _handle_key(device.handle) == key:
                return device
        return self._devices[0] if len(self._devices) == 1 else None

    def _poll(self) -> None:
        nvml = self.nvml
        for device in self._devices:
            if device.lost:
                continue
            h = device.handle
            errors = self._call(
                device,
                "nvmlDeviceGetTotalEccErrors",
                h,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,
            )
            if errors is not None:
                self._ecc_count(device, int(errors))
            rows = self._call(device, "nvmlDeviceGetRemappedRows", h)
            if rows is not None:
                _, _, pending, failure = rows
                self._condition(device, Kind.REMAPPED_ROWS_PENDING, bool(pending))
                self._condition(device, Kind.REMAPPED_ROWS_FAILURE, bool(failure))
            retired = self._call(device, "nvmlDeviceGetRetiredPagesPendingStatus", h)
            if retired is not None:
                self._condition(device, Kind.RETIRED_PAGES_PENDING, bool(retired))
            reasons = self._call(device, "nvmlDeviceGetCurrentClocksEventReasons", h)
            if reasons is not None:
                for bit_name, kind in _SLOWDOWN_BITS.items():
                    self._condition(device, kind, bool(int(reasons) & getattr(nvml, bit_name, 0)))
            self._recovery_action(device)

    def _ecc_count(self, device: _Device, count: int) -> None:
        """Volatile counts include errors from before this process; only an increase is news."""
        baseline = self._ecc_baseline.setdefault(device.name, count)
        if count > baseline:
            detail = f"uncorrected ECC errors on GPU {device.name}: {baseline} -> {count}"
            self._report_kind(device, Kind.ECC_DOUBLE_BIT, detail)

    def _recovery_action(self, device: _Device) -> None:
        field_id = getattr(self.nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None or (device.name, "recovery_action") in self._unsupported:
            return
        values = self._call(device, "nvmlDeviceGetFieldValues", device.handle, [field_id])
        if not values:
            return
        entry = values[0]
        if entry.nvmlReturn != getattr(self.nvml, "NVML_SUCCESS", 0):
            self._unsupported.add((device.name, "recovery_action"))
            log.debug("GPU %s: recovery-action field not available (NVML return %s)", device.name, entry.nvmlReturn)
            return
        member = next((m for t, m in _VALUE_MEMBERS.items() if getattr(self.nvml, t, None) == entry.valueType), "uiVal")
        action = int(getattr(entry.value, member))
        self._reported -= {k for k in self._reported if k[:2] == (device.name, Kind.RECOVERY_ACTION) and k[2] != action}
        if action:
            rule = self.table.recovery_action(action)
            detail = f"GPU {device.name} recovery action {action}"
            self._report(device, Kind.RECOVERY_ACTION, rule, detail, tag=action)

    # ---- reporting -----------------------------------------------------------------------------------------

    def _report(
        self,
        device: _Device | None,
        kind: Kind,
        rule: Rule,
        detail: str,
        *,
        tag: int | None = None,
        xid: int | None = None,
    ) -> None:
        """Report once per device, kind and tag; a condition's key is dropped when it clears."""
        key = (_name(device), kind, tag)
        if key in self._reported:
            return
        self._reported.add(key)
        self.events.report(kind, rule, detail, device=_name(device), xid=xid)

    def _report_kind(self, device: _Device | None, kind: Kind, detail: str) -> None:
        self._report(device, kind, self.table.kind(kind), detail)

    def _condition(self, device: _Device, kind: Kind, active: bool) -> None:
        if active:
            self._report_kind(device, kind, f"GPU {device.name}")
        else:
            self._reported.discard((device.name, kind, None))

    def _lost(self, device: _Device | None) -> None:
        if device is None and len(self._devices) == 1:
            device = self._devices[0]
        if device is None:
            # The event set itself failed; the per-device polls find out which GPU it was.
            self._event_set = None
            self._report_kind(None, Kind.GPU_LOST, "NVML reports a lost GPU while waiting for events")
            return
        device.lost = True
        self._report_kind(device, Kind.GPU_LOST, f"GPU {device.name} is lost")
        if all(d.lost for d in self._devices):
            self._event_set = None

    def _call(self, device: _Device | None, function: str, *args: Any) -> Any:
        """One NVML call; None when it timed out, is not supported, or failed (warned once per call)."""
        name = device.name if device is not None else None
        if (name, function) in self._unsupported:
            return None
        nvml = self.nvml
        try:
            return getattr(nvml, function)(*args)
        except nvml.NVMLError_Timeout:
            return None
        except nvml.NVMLError_GpuIsLost:
            self._lost(device)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound, AttributeError) as exc:
            self._unsupported.add((name, function))
            log.debug("GPU %s: %s not supported (%s); skipped from now on", name, function, exc)
        except nvml.NVMLError as exc:
            if (name, function) not in self._warned:
                self._warned.add((name, function))
                log.warning("GPU %s: %s failed (%s: %s); will keep trying", name, function, type(exc).__name__, exc)
        return None


def _name(device: _Device | None) -> int | str | None:
    return device.name if device is not None else None


def _handle_key(handle: Any) -> object:
    """Compare device handles by address: NVML hands out fresh ctypes pointer objects for one device."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return id(handle)
