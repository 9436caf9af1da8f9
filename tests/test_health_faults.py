"""The fault table as data: defaults from the field notes, user overrides, and clear errors for bad ones."""

from __future__ import annotations

import json

import pytest

from resilience.errors import ConfigError
from resilience.health import FaultTable, HealthConfig, Kind, Severity

FATAL_XIDS = [48, 63, 64, 74, 79, 92, 94, 95, 119, 120]


def test_severities_are_ordered_and_parse_from_names() -> None:
    assert Severity.OK < Severity.DEGRADED < Severity.PREEMPTION < Severity.FATAL
    assert max(Severity.DEGRADED, Severity.FATAL, Severity.PREEMPTION) is Severity.FATAL
    assert Severity.parse("ignore") is Severity.OK
    assert Severity.parse(" Fatal ") is Severity.FATAL
    with pytest.raises(ConfigError, match="unknown severity 'severe'"):
        Severity.parse("severe")


def test_default_table_follows_the_node_health_checkers() -> None:
    table = FaultTable()
    assert all(table.xid(x).severity is Severity.FATAL for x in FATAL_XIDS)
    assert [table.xid(x).severity for x in (13, 31, 43)] == [Severity.DEGRADED] * 3
    assert table.xid(45).severity is Severity.OK and table.xid(68).severity is Severity.OK
    assert table.xid(79).reason == "GPU has fallen off the bus"
    assert table.xid(12345).severity is Severity.DEGRADED
    assert table.kind(Kind.ECC_DOUBLE_BIT).severity is Severity.FATAL
    assert table.kind(Kind.GPU_LOST).severity is Severity.FATAL
    assert table.kind(Kind.THERMAL_SLOWDOWN).severity is Severity.DEGRADED
    assert table.kind(Kind.SIGNAL).severity is Severity.PREEMPTION
    assert table.recovery_action(0).severity is Severity.OK
    assert table.recovery_action(2).severity is Severity.FATAL
    assert table.recovery_action(99).severity is Severity.FATAL


def test_overrides_from_json_merge_over_the_defaults() -> None:
    overrides = json.loads(
        """{"xid": {"13": "fatal", "79": "ignore", "999": {"severity": "fatal", "reason": "site rule"}},
            "kind": {"thermal_slowdown": "ignore", "remapped_rows_pending": "fatal"},
            "recovery_action": {"4": "degraded"},
            "unknown_xid": "ignore"}"""
    )
    table = FaultTable(overrides)
    assert table.xid(13) == (Severity.FATAL, FaultTable().xid(13).reason)
    assert table.xid(79).severity is Severity.OK
    assert table.xid(999) == (Severity.FATAL, "site rule")
    assert table.xid(4242).severity is Severity.OK
    assert table.xid(48).severity is Severity.FATAL, "entries not overridden keep their default"
    assert table.kind(Kind.THERMAL_SLOWDOWN).severity is Severity.OK
    assert table.kind(Kind.REMAPPED_ROWS_PENDING).severity is Severity.FATAL
    assert table.recovery_action(4).severity is Severity.DEGRADED
    assert HealthConfig(fault_table=overrides, inject="").table.xid(13).severity is Severity.FATAL


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"xids": {}}, "unknown section"),
        ({"xid": {"seventy-nine": "fatal"}}, "'seventy-nine' is not an integer"),
        ({"xid": {"79": "severe"}}, "xid 79: unknown severity 'severe'"),
        ({"kind": {"overheating": "fatal"}}, "unknown kind 'overheating'"),
        ({"kind": {"xid": "fatal"}}, "unknown kind 'xid'"),
        ({"xid": {"79": {"reason": "no severity"}}}, "xid 79 needs"),
    ],
)
def test_bad_overrides_name_the_culprit(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FaultTable(overrides)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("grace_s", 0, "grace_s=0"),
        ("hang_factor", 1.0, "above 1"),
        ("check_every_n_steps", 0, "positive integer, or .auto."),
        ("exit_code_preempted", 0, "0 stops the restart"),
        ("exit_code_gpu_fault", 137, "signal exit"),
        ("signals", ("SIGNOPE",), "unknown signal 'SIGNOPE'"),
    ],
)
def test_config_rejects_settings_that_cannot_work(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HealthConfig(**{field: value}, inject="")  # type: ignore[arg-type]
