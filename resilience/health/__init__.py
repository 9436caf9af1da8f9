"""GPU health, preemption signals and hangs: detect, agree across ranks, save, and stop for a restart.

Framework-free: adapters call :class:`HealthGuard` at step boundaries. See ``docs/HEALTH.md``.
"""

from resilience.health.config import EXIT_CODE_GPU_FAULT, EXIT_CODE_PREEMPTED, HealthConfig
from resilience.health.emergency import EmergencySave, StopDeadline, emergency_save
from resilience.health.faults import FaultEvent, FaultTable, Kind, Rule, Severity
from resilience.health.guard import Action, Decision, HealthGuard, signal_watcher
from resilience.health.injection import Injection, InjectionSyntaxError, parse_injections
from resilience.health.nvml import HealthMonitor
from resilience.health.signals import SignalWatcher
from resilience.health.simulated import SimulatedNVML
from resilience.health.watchdog import HangWatchdog

__all__ = [
    "EXIT_CODE_GPU_FAULT",
    "EXIT_CODE_PREEMPTED",
    "Action",
    "Decision",
    "EmergencySave",
    "FaultEvent",
    "FaultTable",
    "HangWatchdog",
    "HealthConfig",
    "HealthGuard",
    "HealthMonitor",
    "Injection",
    "InjectionSyntaxError",
    "Kind",
    "Rule",
    "Severity",
    "SignalWatcher",
    "SimulatedNVML",
    "StopDeadline",
    "emergency_save",
    "parse_injections",
    "signal_watcher",
]
