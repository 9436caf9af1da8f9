"""What a fault is and how bad it is: severities, events, and the fault table as user-overridable data.

The table is data rather than code because sites disagree: one operator drains a node on XID 13, another
ignores it. Overrides come as a plain dict (JSON/YAML friendly) and are merged over the defaults::

    {"xid": {"13": "fatal", "68": "ignore"},
     "kind": {"thermal_slowdown": "ignore"},
     "recovery_action": {"4": "fatal"},
     "unknown_xid": "degraded"}

A value is a severity name (``ok``/``ignore``, ``degraded``, ``preemption``, ``fatal``) or
``{"severity": ..., "reason": ...}``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, NamedTuple

from resilience.errors import ConfigError


class Severity(IntEnum):
    """Ordered, so that the worst of several faults (and the cross-rank agreement) is a plain ``max``."""

    OK = 0
    DEGRADED = 1
    PREEMPTION = 2
    FATAL = 3

    @classmethod
    def parse(cls, value: str | Severity) -> Severity:
        if isinstance(value, Severity):
            return value
        name = str(value).strip().lower()
        if name == "ignore":
            return cls.OK
        try:
            return cls[name.upper()]
        except KeyError:
            raise ConfigError(
                f"unknown severity {value!r}: use one of ok (or ignore), degraded, preemption, fatal"
            ) from None


class Kind(str, Enum):
    """Fault classes; a str enum so events serialise to JSON and metrics as plain names."""

    XID = "xid"
    ECC_DOUBLE_BIT = "ecc_double_bit"
    GPU_LOST = "gpu_lost"
    REMAPPED_ROWS_PENDING = "remapped_rows_pending"
    REMAPPED_ROWS_FAILURE = "remapped_rows_failure"
    RETIRED_PAGES_PENDING = "retired_pages_pending"
    HW_SLOWDOWN = "hw_slowdown"
    THERMAL_SLOWDOWN = "thermal_slowdown"
    POWER_BRAKE_SLOWDOWN = "power_brake_slowdown"
    RECOVERY_ACTION = "recovery_action"
    SIGNAL = "signal"
    HANG = "hang"


# Faults that, when fatal, mean this rank's GPU must not be read again (its memory may be gone or wrong).
GPU_FAULTS = frozenset({Kind.XID, Kind.ECC_DOUBLE_BIT, Kind.GPU_LOST, Kind.REMAPPED_ROWS_FAILURE, Kind.RECOVERY_ACTION})


class Rule(NamedTuple):
    severity: Severity
    reason: str


@dataclass(frozen=True)
class FaultEvent:
    """One observed fault. ``time`` is wall-clock seconds (``time.time()``), so logs of ranks line up."""

    kind: Kind
    severity: Severity
    detail: str
    rank: int
    step: int | None = None
    device: int | str | None = None
    xid: int | None = None
    time: float = field(default_factory=time.time)


_F, _D, _O = Severity.FATAL, Severity.DEGRADED, Severity.OK

# XIDs that common node-health checkers treat as node faults, and app-level ones that usually are not.
DEFAULT_XID_RULES: dict[int, Rule] = {
    48: Rule(_F, "double-bit ECC error"),
    63: Rule(_F, "ECC page retirement or row remapping event"),
    64: Rule(_F, "ECC page retirement or row remapping failure"),
    74: Rule(_F, "NVLink error"),
    79: Rule(_F, "GPU has fallen off the bus"),
    92: Rule(_F, "high single-bit ECC error rate"),
    94: Rule(_F, "contained ECC error"),
    95: Rule(_F, "uncontained ECC error"),
    119: Rule(_F, "GSP RPC timeout"),
    120: Rule(_F, "GSP error"),
    13: Rule(_D, "graphics engine exception, usually an application fault"),
    31: Rule(_D, "GPU memory page fault, usually an application fault"),
    43: Rule(_D, "GPU stopped processing, usually after an application fault"),
    45: Rule(_O, "preemptive cleanup after an earlier error or a killed process"),
    68: Rule(_O, "video decoder exception, not used by training"),
}
DEFAULT_UNKNOWN_XID = Rule(_D, "XID not in the fault table")

DEFAULT_KIND_RULES: dict[Kind, Rule] = {
    Kind.ECC_DOUBLE_BIT: Rule(_F, "uncorrectable (double-bit) ECC error"),
    Kind.GPU_LOST: Rule(_F, "GPU is lost (NVML_ERROR_GPU_IS_LOST)"),
    # Pending remaps apply at the next GPU reset; unaffected work keeps running correctly until then.
    Kind.REMAPPED_ROWS_PENDING: Rule(_D, "row remapping pending: reset the GPU at the next opportunity"),
    Kind.REMAPPED_ROWS_FAILURE: Rule(_F, "row remapping failed: the GPU needs service"),
    Kind.RETIRED_PAGES_PENDING: Rule(_D, "page retirement pending: reset the GPU at the next opportunity"),
    Kind.HW_SLOWDOWN: Rule(_D, "hardware slowdown (clocks reduced by the GPU)"),
    Kind.THERMAL_SLOWDOWN: Rule(_D, "hardware thermal slowdown"),
    Kind.POWER_BRAKE_SLOWDOWN: Rule(_D, "hardware power-brake slowdown"),
    Kind.SIGNAL: Rule(Severity.PREEMPTION, "preemption signal"),
    Kind.HANG: Rule(_D, "step much slower than the running median"),
}

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (driver >= 570); 0 means nothing to do.
DEFAULT_RECOVERY_RULES: dict[int, Rule] = {
    0: Rule(_O, "no recovery action needed"),
    1: Rule(_F, "driver asks for a GPU reset"),
    2: Rule(_F, "driver asks for a node reboot"),
    3: Rule(_F, "driver asks to drain peer-to-peer traffic"),
    4: Rule(_F, "driver asks to drain peer-to-peer traffic and reset the GPU"),
}
DEFAULT_UNKNOWN_RECOVERY = Rule(_F, "driver asks for a recovery action this table does not know")

_SECTIONS = ("xid", "kind", "recovery_action", "unknown_xid", "unknown_recovery_action")


class FaultTable:
    """Maps observations to severities; the defaults above with the user's overrides merged in.

    Args:
        overrides: Dict with any of the sections ``xid``, ``kind``, ``recovery_action`` (each a dict of
            key -> severity or ``{"severity", "reason"}``), ``unknown_xid``, ``unknown_recovery_action``.
            Keys may be strings, as JSON and YAML give them.
    """

    def __init__(self, overrides: Mapping[str, Any] | None = None):
        self._xid = dict(DEFAULT_XID_RULES)
        self._kind = dict(DEFAULT_KIND_RULES)
        self._recovery = dict(DEFAULT_RECOVERY_RULES)
        self._unknown_xid = DEFAULT_UNKNOWN_XID
        self._unknown_recovery = DEFAULT_UNKNOWN_RECOVERY
        self._merge(overrides or {})

    def xid(self, xid: int) -> Rule:
        return self._xid.get(xid, self._unknown_xid)

    def kind(self, kind: Kind) -> Rule:
        return self._kind[kind]

    def recovery_action(self, action: int) -> Rule:
        return self._recovery.get(action, self._unknown_recovery)

    def _merge(self, overrides: Mapping[str, Any]) -> None:
        unknown = sorted(set(overrides) - set(_SECTIONS))
        if unknown:
            raise ConfigError(f"fault table: unknown section(s) {unknown}; sections are {list(_SECTIONS)}")
        for key, value in dict(overrides.get("xid", {})).items():
            xid = _int_key("xid", key)
            self._xid[xid] = _rule(f"xid {key}", value, self.xid(xid).reason)
        for key, value in dict(overrides.get("kind", {})).items():
            kind = _kind_key(key)
            self._kind[kind] = _rule(f"kind {key}", value, self._kind[kind].reason)
        for key, value in dict(overrides.get("recovery_action", {})).items():
            action = _int_key("recovery_action", key)
            self._recovery[action] = _rule(f"recovery_action {key}", value, self.recovery_action(action).reason)
        if "unknown_xid" in overrides:
            self._unknown_xid = _rule("unknown_xid", overrides["unknown_xid"], self._unknown_xid.reason)
        if "unknown_recovery_action" in overrides:
            self._unknown_recovery = _rule(
                "unknown_recovery_action", overrides["unknown_recovery_action"], self._unknown_recovery.reason
            )


def _int_key(section: str, key: object) -> int:
    try:
        return int(str(key))
    except ValueError:
        raise ConfigError(f"fault table: {section} key {key!r} is not an integer") from None


def _kind_key(key: object) -> Kind:
    """XIDs and recovery actions have sections of their own, so only the other kinds are valid here."""
    for kind in DEFAULT_KIND_RULES:
        if kind.value == str(key):
            return kind
    names = [k.value for k in DEFAULT_KIND_RULES]
    raise ConfigError(f"fault table: unknown kind {key!r}; kinds are {names}")


def _rule(where: str, value: Any, default_reason: str) -> Rule:
    if isinstance(value, Mapping):
        extra = sorted(set(value) - {"severity", "reason"})
        if extra or "severity" not in value:
            raise ConfigError(f"fault table: {where} needs {{'severity': ..., 'reason': ...}}, got {dict(value)}")
        return Rule(_parse(where, value["severity"]), str(value.get("reason", default_reason)))
    return Rule(_parse(where, value), default_reason)


def _parse(where: str, value: Any) -> Severity:
    try:
        return Severity.parse(value)
    except ConfigError as exc:
        raise ConfigError(f"fault table: {where}: {exc}") from None
