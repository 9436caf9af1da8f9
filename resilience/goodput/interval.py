"""How often to save, from what a save costs and how often the job fails (Young's first-order optimum).

Saving every T seconds costs C/T of the time in blocking saves, and a failure throws away T/2 of work on
average, T/(2 MTBF) of the time. The sum is smallest at T = sqrt(2 C MTBF), where both parts are equal.
Daly's higher-order correction changes T by well under 1% while C is seconds and MTBF hours, so it is left
out. Assumptions: failures independent at a steady rate; C is the *blocking* part of a save (an async
save's background write is free unless it delays the next save); restart and restore time do not depend on T.

:class:`SessionInterval` is the training session's part: when it saves on its own, a fixed number of steps
or this interval, planned on rank 0 and agreed by all.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from resilience.errors import ConfigError
from resilience.goodput.ledger import ledger_dir
from resilience.goodput.summary import summarize

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)

# Llama 3 pre-training: 419 interruptions in 54 days on 16,384 GPUs, about one per 5.8 GPU-years.
PER_GPU_MTBF_S = 54 * 86400 * 16384 / 419


def young_daly_interval(cost_s: float, mtbf_s: float, *, min_s: float = 0.0, max_s: float = math.inf) -> float:
    """sqrt(2 * cost_s * mtbf_s), clamped to [min_s, max_s]."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"cost_s={cost_s}, mtbf_s={mtbf_s}: need cost_s >= 0 and mtbf_s > 0")
    return min(max_s, max(min_s, math.sqrt(2.0 * cost_s * mtbf_s)))


@dataclass(frozen=True)
class IntervalPlan:
    """A chosen save interval and what it is expected to cost."""

    interval_s: float
    interval_steps: int | None
    cost_s: float | None
    mtbf_s: float
    mtbf_source: str
    step_s: float | None
    clamped: bool
    expected_overhead: float
    expected_lost_s_per_failure: float
    expected_waste: float
    uptime_s: float = 0.0
    failures: int = 0
    gpus: int = 1
    bounds: tuple[float, float] = (0.0, math.inf)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def metrics(self, interval_steps: int, prefix: str = "checkpoint/") -> dict[str, float]:
        """The plan for loggers and trackers; ``interval_steps`` is the one the ranks agreed on."""
        return {
            f"{prefix}interval_steps": float(interval_steps),
            f"{prefix}interval_s": self.interval_s,
            f"{prefix}expected_overhead": self.expected_overhead,
            f"{prefix}expected_lost_s_per_failure": self.expected_lost_s_per_failure,
            f"{prefix}mtbf_s": self.mtbf_s,
        }

    def describe(self) -> str:
        """The plan in words a user can check: the interval, and the two figures it comes from."""
        steps = f" ({self.interval_steps} steps of {self.step_s:.2f} s)" if self.interval_steps and self.step_s else ""
        if self.cost_s is None:
            return (
                f"save in {_duration(self.interval_s)}{steps}, to measure what a save costs; the interval is "
                f"then planned from that cost and how often the job fails ({self._failure_text()})"
            )
        low, high = self.bounds
        bound = f"; held at min_interval_s={low:g}" if self.clamped and self.interval_s <= low else ""
        bound = f"; held at max_interval_s={high:g}" if self.clamped and self.interval_s >= high else bound
        waste = (
            f"{_percent(self.expected_waste)} of the time lost in all"
            if self.expected_waste < 1
            else "the job fails more often than saves can keep up with: each failure redoes half an interval"
        )
        return (
            f"save every {_duration(self.interval_s)}{steps}{bound}: a save blocks training {self.cost_s:.2f} s, "
            f"and the job is expected to fail every {_duration(self.mtbf_s)} ({self._failure_text()}). Expected: "
            f"{_percent(self.expected_overhead)} of the time in saves, {_duration(self.expected_lost_s_per_failure)} "
            f"of work redone per failure, {waste}"
        )

    def _failure_text(self) -> str:
        seen = f"{_duration(self.uptime_s)} of this run" if self.uptime_s >= 1 else "this run so far"
        if self.mtbf_source == "given":
            return "mtbf_hours, as configured"
        if self.mtbf_source == "observed":
            return f"{self.failures} failure{'s' if self.failures != 1 else ''} in {seen}"
        return (
            f"a prior: one failure per {PER_GPU_MTBF_S / (365 * 86400):.1f} GPU-years, Llama 3's rate, over "
            f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}; no failure in {seen}"
        )


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2f}%" if fraction >= 0.0001 else "under 0.01%"


def _duration(seconds: float) -> str:
    """Seconds as a person reads them: 45 s, 12 min, 3.5 h, 2.1 days, 3.0 years."""
    for unit, size in (("years", 365 * 86400.0), ("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}" if unit != "min" else f"{seconds / size:.0f} min"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


class AdaptiveInterval:
    """The save interval for ``save_every="auto"``: re-planned as saves are measured and failures observed.

    Args:
        mtbf_s: Mean time between failures of the whole job, when known; else estimated from the run.
        world_size: Scales the prior MTBF (:data:`PER_GPU_MTBF_S` per GPU) before any failure is seen.
        min_s, max_s: Clamp of the interval; before any save is measured, the interval is ``min_s`` so the
            first save comes early and gives a cost.
        history: How many recent saves' blocking costs the median is taken over (one slow save, e.g. the
            first with its allocations, does not swing the interval).
    """

    def __init__(
        self,
        *,
        mtbf_s: float | None = None,
        world_size: int = 1,
        min_s: float = 60.0,
        max_s: float = 6 * 3600.0,
        history: int = 5,
    ) -> None:
        if min_s <= 0 or max_s < min_s:
            raise ValueError(f"min_s={min_s}, max_s={max_s}: need 0 < min_s <= max_s")
        self.mtbf_s = mtbf_s
        self.gpus = max(1, world_size)
        self.prior_mtbf_s = PER_GPU_MTBF_S / self.gpus
        self.min_s = min_s
        self.max_s = max_s
        self._costs: deque[float] = deque(maxlen=history)
        self._uptime_s = 0.0
        self._failures = 0

    def observe_cost(self, block_s: float) -> None:
        """A save blocked training this long (``SaveHandle.timings["block_s"]`` plus any staging wait)."""
        self._costs.append(block_s)

    def observe_run(self, uptime_s: float, failures: int) -> None:
        """The run so far (e.g. ``summary.uptime_s``, ``summary.failures`` of :func:`summarize`)."""
        self._uptime_s, self._failures = uptime_s, failures

    def observe_ledger(self, run_dir: str | os.PathLike[str]) -> None:
        """Take the run's uptime and failures from its goodput ledger, when earlier incarnations wrote one."""
        if any(ledger_dir(run_dir).glob("incarnation-*.jsonl")):
            summary = summarize(run_dir)
            self.observe_run(summary.uptime_s, summary.failures)

    def mtbf(self) -> tuple[float, str]:
        """MTBF and where it came from: given, observed (uptime per failure), or the prior.

        With no failure seen yet, the run's uptime is a lower bound, so the larger of it and the prior is used.
        """
        if self.mtbf_s is not None:
            return self.mtbf_s, "given"
        if self._failures:
            return self._uptime_s / self._failures, "observed"
        return max(self.prior_mtbf_s, self._uptime_s), "prior"

    def plan(self, step_s: float | None = None) -> IntervalPlan:
        """The interval now; ``step_s`` (wall seconds per step) converts it to steps."""
        mtbf_s, source = self.mtbf()
        cost = statistics.median(self._costs) if self._costs else None
        if cost is None:
            interval, clamped = self.min_s, False
        else:
            raw = math.sqrt(2.0 * cost * mtbf_s)
            interval = young_daly_interval(cost, mtbf_s, min_s=self.min_s, max_s=self.max_s)
            clamped = interval != raw
        return IntervalPlan(
            interval_s=interval,
            interval_steps=max(1, round(interval / step_s)) if step_s else None,
            cost_s=cost,
            mtbf_s=mtbf_s,
            mtbf_source=source,
            step_s=step_s,
            clamped=clamped,
            expected_overhead=(cost or 0.0) / interval,
            expected_lost_s_per_failure=interval / 2.0,
            expected_waste=(cost or 0.0) / interval + interval / (2.0 * mtbf_s),
            uptime_s=self._uptime_s,
            failures=self._failures,
            gpus=self.gpus,
            bounds=(self.min_s, self.max_s),
        )


@dataclass
class IntervalConfig:
    """When the session saves on its own.

    Attributes:
        every_n_steps: Save every N optimizer steps (at steps that are multiples of N), ``"auto"`` for the
            Young/Daly interval ``sqrt(2 * C * MTBF)`` from the measured blocking cost C of a save, or None for
            no interval saves.
        mtbf_hours: With ``"auto"``: the job's mean time between failures, if known; else observed from the run's
            restarts in its goodput ledger, else a prior of 5.8 GPU-years per GPU.
        min_interval_s: With ``"auto"``: the shortest interval it may choose.
        max_interval_s: With ``"auto"``: the longest interval it may choose.
        warmup_steps: With ``"auto"``: the first save comes this many steps in, to measure what a save costs.
    """

    every_n_steps: int | Literal["auto"] | None = None
    mtbf_hours: float | None = None
    min_interval_s: float = 60.0
    max_interval_s: float = 6 * 3600.0
    warmup_steps: int = 5

    def __post_init__(self) -> None:
        every = self.every_n_steps
        if (
            every is not None
            and every != "auto"
            and (isinstance(every, bool) or not isinstance(every, int) or every < 1)
        ):
            raise ConfigError(f"every_n_steps={every!r}: use a positive number of optimizer steps, 'auto' or None")
        if self.mtbf_hours is not None and self.mtbf_hours <= 0:
            raise ConfigError(f"mtbf_hours={self.mtbf_hours}: use a positive number of hours")
        if self.min_interval_s <= 0 or self.max_interval_s < self.min_interval_s:
            raise ConfigError(
                f"min_interval_s={self.min_interval_s}, max_interval_s={self.max_interval_s}: need "
                "0 < min_interval_s <= max_interval_s"
            )
        if self.warmup_steps < 1:
            raise ConfigError(f"warmup_steps={self.warmup_steps}: use 1 or more")


RunSoFar = Callable[[], tuple[float, int] | None]  # the run's uptime and failures, when its ledger tells them


class SessionInterval:
    """The session's save interval: which boundaries save, and for ``"auto"`` the plan after each save.

    The session reports what the plan is made of as it happens: each step's time, each save started, and every
    second saves blocked training (the cost of a save is the blocking time since the last plan over the saves
    started since). Without :meth:`use` no boundary is due.

    Args:
        manager: Its control group agrees on a plan (rank 0 plans, every rank saves at the same steps); its world
            size scales the prior MTBF.
        emit: Where each plan's metrics go.
        is_main: Whether this process logs the plans.
    """

    def __init__(self, manager: CheckpointManager, *, emit: Callable[[dict[str, float]], None], is_main: bool) -> None:
        self._manager = manager
        self._emit = emit
        self._is_main = is_main
        self.config: IntervalConfig | None = None
        self.last_plan: IntervalPlan | None = None
        self._planner: AdaptiveInterval | None = None
        self._next_step = 0  # with "auto": the next boundary that saves
        self._steps: int | None = None  # with "auto": the agreed interval, once planned (or restored)
        self._restored_next_step: int | None = None
        self._cost_s = 0.0  # blocking time since the last plan
        self._saves = 0  # saves started since the last plan
        self._step_times: deque[float] = deque(maxlen=50)

    def use(self, config: IntervalConfig) -> None:
        self.config = config
        if config.every_n_steps == "auto":
            self._planner = AdaptiveInterval(
                mtbf_s=None if config.mtbf_hours is None else config.mtbf_hours * 3600.0,
                world_size=self._manager.world_size,
                min_s=config.min_interval_s,
                max_s=config.max_interval_s,
            )

    def state(self) -> dict[str, Any]:
        """What the ``"auto"`` interval must keep across a restart (so it does not warm up again)."""
        return {"next_step": self._next_step, "interval_steps": self._steps}

    def load_state(self, state: dict[str, Any]) -> None:
        if self._planner is not None and state.get("interval_steps"):
            self._steps = int(state["interval_steps"])
            self._restored_next_step = int(state["next_step"])

    def start(self, step: int) -> None:
        """Training begins at ``step``: the first ``"auto"`` save is the restored plan's, or after the warm-up."""
        self._next_step = self._restored_next_step or step + (self.config.warmup_steps if self.config else 0)

    def step_took(self, seconds: float) -> None:
        self._step_times.append(seconds)

    def save_started(self) -> None:
        self._saves += 1

    def stalled(self, seconds: float) -> None:
        self._cost_s += seconds

    def due(self, step: int) -> bool:
        """Whether the boundary of ``step`` saves (the same answer on every rank)."""
        config = self.config
        if config is None or config.every_n_steps is None or step <= 0:
            return False
        if self._planner is None:
            return step % int(config.every_n_steps) == 0
        return step >= self._next_step

    def replan(self, step: int, run_so_far: RunSoFar) -> None:
        """After the interval save of ``step``: with ``"auto"``, plan the next one from what saves cost so far."""
        if self._planner is None or self.config is None:
            return
        planner, cost, saves = self._planner, self._cost_s, self._saves
        step_s = statistics.median(self._step_times) if self._step_times else None

        def plan() -> IntervalPlan:
            if saves:
                planner.observe_cost(cost / saves)
            run = run_so_far()
            if run is not None:
                planner.observe_run(*run)
            return planner.plan(step_s=step_s)

        chosen = self._manager.groups.control.decide(plan)
        self._cost_s, self._saves = 0.0, 0
        self._steps = chosen.interval_steps or self.config.warmup_steps
        self._next_step = step + self._steps
        self.last_plan = chosen
        self._emit(chosen.metrics(self._steps))
        if self._is_main:
            log.info("every_n_steps='auto': the next save at step %d; %s", self._next_step, chosen.describe())
