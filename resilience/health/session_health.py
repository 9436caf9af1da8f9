"""The training session's part in health monitoring: the guard's decision at each step boundary, and what a
fault needs at once, from the monitor's threads, before any boundary.

At once: a fatal GPU fault makes this rank's device unreadable (its share of any save comes from a replica, and
its RNG streams are not captured), and a hang may be a lost peer, which only a survivor save helps. The rest
waits for the boundary: the agreed decision, the emergency save of a stop, and the count of faults for the
metrics.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NoReturn

from resilience.checkpoint import rng
from resilience.errors import ConfigError
from resilience.health.config import HealthConfig
from resilience.health.faults import GPU_FAULTS, FaultEvent, Kind, Severity
from resilience.health.guard import Decision, EmergencySave, HealthGuard
from resilience.health.injection import ENV_VAR as INJECT_ENV_VAR
from resilience.health.signals import SignalWatcher

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager


class SessionHealth:
    """The session's health watch; nothing is watched until :meth:`use`.

    Args:
        manager: Told when this rank's device must not be read again.
        emit: Where the fault counts and an emergency save's figures go.
        on_hang: Called from the watchdog's thread when training hangs.
        rescuing: Whether a survivor save is under way (a hang past ``hang_exit_s`` leaves it to finish).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        emit: Callable[[dict[str, float]], None],
        on_hang: Callable[[], None],
        rescuing: Callable[[], bool],
    ) -> None:
        self._manager = manager
        self._emit = emit
        self._on_hang = on_hang
        self._rescuing = rescuing
        self.guard: HealthGuard | None = None
        self._events: list[FaultEvent] = []

    def use(self, config: HealthConfig, *, nvml: Any = None, signals: SignalWatcher | None = None) -> HealthGuard:
        """Watch GPU health, preemption signals and hangs; collective (it creates the check's gloo group)."""
        if self.guard is None:
            self.guard = HealthGuard(config, nvml=nvml, listeners=[self._event], signals=signals)
            self.guard.rescue_under_way = self._rescuing
        return self.guard

    def _event(self, event: FaultEvent) -> None:
        """From the monitor's threads: count it, and act on what cannot wait for the boundary."""
        self._events.append(event)
        if event.kind is Kind.HANG:
            self._on_hang()
        if event.severity is Severity.FATAL and event.kind in GPU_FAULTS:
            # this rank's GPU must not be read again: its share of any save comes from a replica
            self._manager.device_unreadable = event.detail
            rng.DEVICE_UNREADABLE = True

    def check_drill(self) -> None:
        """Before training: a planned fault drill needs the health watch, or nothing would be injected."""
        if self.guard is None and os.environ.get(INJECT_ENV_VAR, "").strip():
            raise ConfigError(
                f"{INJECT_ENV_VAR}={os.environ[INJECT_ENV_VAR]!r} plans a fault drill, but this run does not watch "
                "health, so nothing would be injected: add HealthGuardCallback() to the Trainer (Lightning), or set "
                "ACCELERATE_RESILIENCE_HEALTH=1 (Accelerate), or unset the variable"
            )

    def start(self) -> None:
        if self.guard is not None:
            self.guard.start()  # signal handlers: the main thread

    def on_step(self, step: int) -> Decision | None:
        """The ranks' agreed decision at the boundary of ``step`` (collective); None without a health watch."""
        return self.guard.on_step(step) if self.guard is not None else None

    def emergency_save(self, step: int, save: Callable[[], object]) -> EmergencySave:
        """A stop's save of ``step`` within the grace period, counted from this rank's fault."""
        assert self.guard is not None
        result = self.guard.emergency_save(self._manager, step, save=save)
        metrics = {"health/emergency_local_committed": float(result.local_committed)}
        if result.fault_to_local_s is not None:
            metrics["health/fault_to_commit_s"] = result.fault_to_local_s
        self._emit(metrics)
        return result

    def flush_events(self) -> None:
        """How many faults of each severity this rank saw since the last boundary."""
        events, self._events[:] = list(self._events), []
        counts: dict[str, float] = {}
        for event in events:
            key = f"health/{event.severity.name.lower()}_events"
            counts[key] = counts.get(key, 0.0) + 1
        self._emit(counts)

    def paused(self) -> AbstractContextManager[None]:
        """Work between steps (validation) is not a hang."""
        return self.guard.paused() if self.guard is not None else contextlib.nullcontext()

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()

    def stop(self) -> NoReturn:
        """Leave the process with the agreed stop's code."""
        assert self.guard is not None
        self.guard.stop()
