"""Fault injection: the RESILIENCE_INJECT syntax, and drills that flow through the real monitor and guard.

Without an NVML driver (as in CI) the drills also cover the fallback to a simulated GPU.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import pytest

from resilience.health import (
    Action,
    HealthConfig,
    HealthGuard,
    Injection,
    InjectionSyntaxError,
    Kind,
    Severity,
    parse_injections,
)


def test_parse_several_faults() -> None:
    plan = parse_injections(" xid=79@step=5,rank=1; ecc@step=3 ;gpu_lost@rank=0,step=4;signal=SIGTERM@step=7;")
    assert plan == [
        Injection("xid", 5, 1, 79),
        Injection("ecc", 3),
        Injection("gpu_lost", 4, 0),
        Injection("signal", 7, None, int(signal.SIGTERM)),
    ]
    assert [str(i) for i in plan[:3]] == ["xid=79@step=5,rank=1", "ecc@step=3", "gpu_lost@step=4,rank=0"]
    assert parse_injections("signal=usr1@step=2")[0].value == signal.SIGUSR1
    assert parse_injections("") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("xid=79", "'xid=79': missing '@step=N'"),
        ("xid@step=5", "xid needs a number"),
        ("xid=abc@step=5", "xid needs a number"),
        ("ecc=2@step=3", "ecc takes no value"),
        ("meltdown@step=3", "unknown fault 'meltdown'"),
        ("signal=SIGNOPE@step=3", "unknown signal 'SIGNOPE'"),
        ("gpu_lost@rank=0", "missing step=N"),
        ("gpu_lost@step=-1", "step must be a non-negative integer"),
        ("gpu_lost@step=4,node=2", "expected step=N or rank=R, got 'node=2'"),
        ("gpu_lost@step=4,step=5", "step given twice"),
        ("ecc@step=1;xid=79@stp=5", "part 'xid=79@stp=5'"),
    ],
)
def test_bad_specs_name_the_part_and_show_the_syntax(text: str, message: str) -> None:
    with pytest.raises(InjectionSyntaxError, match=message) as info:
        parse_injections(text)
    assert "Syntax: FAULT@step=N[,rank=R]" in str(info.value)


def test_injection_api_checks_its_arguments() -> None:
    with pytest.raises(InjectionSyntaxError, match="needs a value"):
        Injection("xid", step=3)
    with pytest.raises(InjectionSyntaxError, match="unknown fault"):
        Injection("fire", step=3)


@pytest.fixture
def drill(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., HealthGuard]]:
    """Start a guard whose plan comes from RESILIENCE_INJECT, as a user's unchanged job would."""
    guards: list[HealthGuard] = []

    def start(spec: str, rank: int = 0) -> HealthGuard:
        monkeypatch.setenv("RESILIENCE_INJECT", spec)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        guard = HealthGuard(HealthConfig(poll_interval_s=0.05, watchdog=False)).start()
        guards.append(guard)
        return guard

    yield start
    for guard in guards:
        guard.close()


@pytest.mark.parametrize(
    ("spec", "kind", "severity", "exit_code"),
    [
        ("xid=79@step=5,rank=1", Kind.XID, Severity.FATAL, 69),
        ("ecc@step=5", Kind.ECC_DOUBLE_BIT, Severity.FATAL, 69),
        ("gpu_lost@step=5,rank=1", Kind.GPU_LOST, Severity.FATAL, 69),
        ("signal=SIGUSR1@step=5", Kind.SIGNAL, Severity.PREEMPTION, 75),
    ],
)
def test_env_injection_stops_at_the_given_step(
    drill: Callable[..., HealthGuard], spec: str, kind: Kind, severity: Severity, exit_code: int
) -> None:
    guard = drill(spec, rank=1)
    decisions = [guard.on_step(step) for step in range(1, 7)]
    assert [d.action for d in decisions[:4]] == [Action.CONTINUE] * 4
    stop = decisions[4]
    assert stop.stop and stop.step == 5 and stop.severity is severity and stop.exit_code == exit_code
    assert [e.kind for e in stop.events] == [kind] and stop.source_rank == 1
    assert decisions[5].stop, "a stop decision stays until the process stops"


def test_injection_for_another_rank_does_nothing_here(drill: Callable[..., HealthGuard]) -> None:
    guard = drill("xid=79@step=2,rank=1;signal=SIGTERM@step=2,rank=1", rank=0)
    assert all(guard.on_step(step).action is Action.CONTINUE for step in range(1, 5))
    assert guard.events.events == []


def test_a_restarted_run_that_resumes_after_the_drill_step_is_not_hit_again(
    drill: Callable[..., HealthGuard],
) -> None:
    guard = drill("xid=79@step=6", rank=0)  # the same environment as the run the drill stopped at step 6
    assert all(guard.on_step(step).action is Action.CONTINUE for step in range(7, 12))
    assert guard.events.events == []


def test_injected_signal_must_be_watched(drill: Callable[..., HealthGuard]) -> None:
    from resilience.errors import ConfigError

    with pytest.raises(ConfigError, match="not among the watched signals"):
        drill("signal=SIGUSR2@step=1")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "nothing was installed"
