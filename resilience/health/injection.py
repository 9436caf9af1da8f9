"""Fault injection: rehearse a failure of your own job with no code change.

Set ``RESILIENCE_INJECT`` (or ``HealthConfig.inject``, or call ``HealthGuard.inject``) to one or more faults
separated by ``;``::

    FAULT@step=N[,rank=R]

    FAULT  xid=<number>        an XID event, e.g. xid=79 (GPU has fallen off the bus)
           ecc                 a double-bit ECC event
           gpu_lost            every NVML call answers NVMLError_GpuIsLost from then on
           signal=<name|num>   that signal sent to this process, e.g. signal=SIGTERM, signal=USR1
           slow=<factor>       from then on each step of this rank takes <factor> times as long (a straggler:
                               a sleep at its step boundary, see :mod:`resilience.health.stragglers`)
    step=N fires at the first step boundary whose step is >= N
    rank=R only on global rank R (default: on every rank)

Examples::

    RESILIENCE_INJECT="xid=79@step=5,rank=1"
    RESILIENCE_INJECT="ecc@step=3"
    RESILIENCE_INJECT="gpu_lost@step=4,rank=0;signal=SIGTERM@step=7"
    RESILIENCE_INJECT="slow=2.0@step=0,rank=1"

GPU faults are injected by faking NVML's answers at the call boundary (see
:class:`~resilience.health.simulated.SimulatedNVML`), so the real monitor code path reports them; without a
driver they go to a simulated GPU. A signal is really sent, so the real handler runs. A slow rank is slowed by
the session's straggler part, not here. Each fault fires once per job: a run restarted past its step skips it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from resilience.errors import ConfigError
from resilience.health.faults import Kind
from resilience.health.signals import parse_signal
from resilience.health.simulated import SimulatedNVML

log = logging.getLogger(__name__)

ENV_VAR = "RESILIENCE_INJECT"
SYNTAX = (
    "FAULT@step=N[,rank=R], several joined by ';', where FAULT is xid=<number>, ecc, gpu_lost, "
    "signal=<SIGTERM|SIGUSR1|number> or slow=<factor above 1>; e.g. 'xid=79@step=5,rank=1;signal=SIGTERM@step=7'"
)
SLOW = "slow"
# The event kind each GPU fault shows up as once the monitor has seen it.
_GPU_FAULTS = {"xid": Kind.XID, "ecc": Kind.ECC_DOUBLE_BIT, "gpu_lost": Kind.GPU_LOST}
_FAULTS = (*_GPU_FAULTS, "signal", SLOW)


class InjectionSyntaxError(ConfigError):
    """A fault-injection spec does not parse; the message names the bad part and shows the syntax."""


@dataclass(frozen=True)
class Injection:
    """One planned fault. ``value`` is the XID for ``xid`` and the signal number for ``signal``; ``factor`` how many
    times as long each step of a ``slow`` rank takes."""

    fault: str
    step: int
    rank: int | None = None
    value: int | None = None
    factor: float | None = None

    def __post_init__(self) -> None:
        if self.fault not in _FAULTS:
            raise InjectionSyntaxError(f"unknown fault {self.fault!r}; syntax: {SYNTAX}")
        if (self.factor is not None) != (self.fault == SLOW) or (
            self.factor is not None and not 1 < self.factor < math.inf
        ):
            raise InjectionSyntaxError(f"slow needs a factor above 1, e.g. slow=2.0; syntax: {SYNTAX}")
        if (self.value is None) != (self.fault in ("ecc", "gpu_lost", SLOW)):
            need = "needs a value" if self.value is None else "takes no value"
            raise InjectionSyntaxError(f"fault {self.fault!r} {need}; syntax: {SYNTAX}")
        if self.step < 0 or (self.rank is not None and self.rank < 0):
            raise InjectionSyntaxError(f"step and rank must be non-negative in {self}; syntax: {SYNTAX}")

    @property
    def kind(self) -> Kind | None:
        """The GPU fault event this produces; None for a signal, which the signal watcher reports."""
        return _GPU_FAULTS.get(self.fault)

    def __str__(self) -> str:
        value = "" if self.value is None else f"={self.value}"
        value = f"={self.factor:g}" if self.factor is not None else value
        rank = "" if self.rank is None else f",rank={self.rank}"
        return f"{self.fault}{value}@step={self.step}{rank}"


def parse_injections(text: str) -> list[Injection]:
    """Parse the ``RESILIENCE_INJECT`` syntax (module docstring); empty text means no injection."""
    return [_parse_one(part.strip()) for part in text.split(";") if part.strip()]


def _parse_one(part: str) -> Injection:
    def bad(why: str) -> InjectionSyntaxError:
        return InjectionSyntaxError(f"{ENV_VAR} part {part!r}: {why}. Syntax: {SYNTAX}")

    fault_text, at, where = part.partition("@")
    if not at:
        raise bad("missing '@step=N'")
    fault, _, value_text = (s.strip() for s in fault_text.partition("="))
    fault = fault.lower()
    if fault not in _FAULTS:
        raise bad(f"unknown fault {fault!r}")
    value: int | None = None
    factor: float | None = None
    if fault == SLOW:
        try:
            factor = float(value_text)
        except ValueError:
            raise bad("slow needs a factor, e.g. slow=2.0") from None
        if not 1 < factor < math.inf:
            raise bad(f"slow={value_text}: use a finite factor above 1 (2.0: each step takes twice as long)")
    elif fault == "xid":
        if not value_text.isdigit():
            raise bad("xid needs a number, e.g. xid=79")
        value = int(value_text)
    elif fault == "signal":
        try:
            value = int(parse_signal(value_text))
        except ConfigError as exc:
            raise bad(str(exc)) from None
    elif value_text:
        raise bad(f"{fault} takes no value")
    fields: dict[str, int] = {}
    for item in where.split(","):
        key, eq, number = (s.strip() for s in item.partition("="))
        if key not in ("step", "rank") or not eq:
            raise bad(f"expected step=N or rank=R, got {item.strip()!r}")
        if not number.isdigit():
            raise bad(f"{key} must be a non-negative integer, got {number!r}")
        if key in fields:
            raise bad(f"{key} given twice")
        fields[key] = int(number)
    if "step" not in fields:
        raise bad("missing step=N")
    return Injection(fault, fields["step"], fields.get("rank"), value, factor)


def due_in_this_run(pending: list[Injection], first_step: int, rank: int) -> list[Injection]:
    """``pending`` (sorted by step) less what was due before this process's first step ``first_step``: a restarted
    run resumed past a fault's step does not fire it again (the drill already happened in the run that was there).
    """
    skipped = [i for i in pending if i.step < first_step]
    for injection in skipped:
        log.info("rank %d: %s was due before this run's first step %d; not injected", rank, injection, first_step)
    return pending[len(skipped) :]


class FaultInjector:
    """Fires this rank's planned faults at step boundaries (a slow rank's are the straggler part's).

    Args:
        injections: The plan (all ranks); only this rank's entries are kept.
        rank: This process's global rank.
        nvml: Where GPU faults go; required when the plan has any.
    """

    def __init__(self, injections: list[Injection], rank: int, nvml: SimulatedNVML | None = None):
        self.rank = rank
        self.nvml = nvml
        mine = (i for i in injections if i.rank in (None, rank) and i.fault != SLOW)
        self.pending = sorted(mine, key=lambda i: i.step)
        self._first_step: int | None = None
        if nvml is None and any(i.kind is not None for i in self.pending):
            raise ConfigError("GPU fault injection needs an NVML stand-in to inject into")

    def fire(self, step: int) -> list[Injection]:
        """Inject every planned fault due at ``step``; returns what was injected.

        A fault planned for a step this process never passes through (a restarted run resumed after it) is
        dropped, not fired late: the drill already happened in the run that was there.
        """
        if self._first_step is None:
            self._first_step = step
            self.pending = due_in_this_run(self.pending, step, self.rank)
        due = [i for i in self.pending if i.step <= step]
        self.pending = self.pending[len(due) :]
        for injection in due:
            log.warning("rank %d: injecting %s at step %d (fault drill)", self.rank, injection, step)
            if injection.fault == "signal":
                assert injection.value is not None
                os.kill(os.getpid(), injection.value)
                continue
            assert self.nvml is not None
            if injection.fault == "gpu_lost":
                self.nvml.lost = True
            elif injection.fault == "xid":
                self.nvml.push_event(self.nvml.nvmlEventTypeXidCriticalError, injection.value or 0)
            else:
                self.nvml.push_event(self.nvml.nvmlEventTypeDoubleBitEccError)
        return due
