"""Stragglers: a rank persistently slower than its peers, found from how each rank's step time splits.

In a synchronous job every rank's step takes the same wall time: the fast ranks wait for the slow one inside
the gradient all-reduce. So the step time alone names nobody; its split does. Each rank measures its own steps:

* data wait: blocked in the loader's ``next()`` (the goodput part measures it);
* waiting in collectives: from its backward's last gradient to the optimizer's update, the time DDP's last
  all-reduce takes here, which on a fast rank includes waiting for the slow one;
* compute: the rest (forward, backward, the optimizer, the step boundary's own work).

A rank's own time is its compute plus its data wait. Every ``window`` steps (at steps that are multiples of it,
the same on every rank) the ranks all-gather their sums: one small collective on the checkpoint engine's control
group. A rank whose own time is more than ``factor`` times the median of the others', ``windows`` windows running,
is a straggler: it is logged, sent to the metrics sinks and written to the goodput ledger (``resilience report``
shows it). With ``replace`` under ``resilience launch``, the straggler is ended the way a hung rank is, and the
survivors save and restart in place with a warm spare in its place.

The drill ``RESILIENCE_INJECT="slow=2.0@step=N,rank=R"`` makes rank R's steps take twice as long from step N: at
each step boundary it sleeps ``factor - 1`` times its step's own time.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from resilience import env_settings as env
from resilience.checkpoint.updates import before_update
from resilience.errors import ConfigError
from resilience.health.injection import SLOW, Injection, due_in_this_run
from resilience.recovery import inplace

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)
ENV_PREFIX = "RESILIENCE_STRAGGLER_"
EVICTED_WAIT_S = 120.0  # how long a straggler that asked to be replaced waits for the launcher to end it


@dataclass
class StragglerConfig:
    """How stragglers are found and what is done about them; a field left out is read from
    ``RESILIENCE_STRAGGLER_<FIELD>``, else takes its default.

    Attributes:
        enabled: Compare the ranks (one all-gather of four numbers per rank every ``window`` steps). Default: true.
        window: Steps per comparison. Default: 20.
        windows: Windows running a rank must be slow in before it is named (one slow window is noise). Default: 2.
        factor: A rank is slow when its own time (compute and data wait) exceeds this times the others' median.
            Default: 1.5.
        min_excess_s: ... and exceeds it by at least this many seconds per step (jitter of very short steps).
            Default: 0.002.
        replace: Under ``resilience launch``, end the straggler so that a warm spare takes its place (the
            survivors save and restart in place); at most once per window. Default: false.
    """

    enabled: bool = env.setting(True, env.boolean)
    window: int = env.setting(20, env.integer)
    windows: int = env.setting(2, env.integer)
    factor: float = env.setting(1.5, env.number)
    min_excess_s: float = env.setting(0.002, env.number)
    replace: bool = env.setting(False, env.boolean)

    def __post_init__(self) -> None:
        from_env = env.fill_from_env(self, ENV_PREFIX)
        try:
            self._check()
        except ConfigError as exc:
            raise ConfigError(env.blame(str(exc), from_env)) from None

    def _check(self) -> None:
        if self.window < 2:
            raise ConfigError(f"window={self.window}: use 2 steps or more (20 is a good start)")
        if self.windows < 1:
            raise ConfigError(f"windows={self.windows}: use 1 window or more")
        if not self.factor > 1:
            raise ConfigError(f"factor={self.factor}: use a factor above 1 (1.5 is a good start)")
        if self.min_excess_s < 0:
            raise ConfigError(f"min_excess_s={self.min_excess_s}: use 0 or more seconds")


@dataclass(frozen=True)
class Split:
    """One rank's steps in a window, in seconds per step: step time, data wait and waiting in collectives."""

    step_s: float
    data_s: float
    wait_s: float

    @property
    def own_s(self) -> float:
        """Compute and data wait: the step less its waiting for the other ranks."""
        return max(0.0, self.step_s - self.wait_s)

    @property
    def compute_s(self) -> float:
        return max(0.0, self.own_s - self.data_s)


@dataclass(frozen=True)
class Straggler:
    """A rank named slow at the end of a window, with where its excess went (seconds per step)."""

    rank: int
    step: int
    ratio: float
    own_s: float
    others_own_s: float
    extra_compute_s: float
    extra_data_s: float
    others_wait_s: float

    def describe(self) -> str:
        return (
            f"rank {self.rank} is a straggler: its own time per step is {self.ratio:.2f}x the other ranks' median "
            f"({1e3 * self.own_s:.1f} ms against {1e3 * self.others_own_s:.1f} ms), from compute "
            f"{1e3 * self.extra_compute_s:+.1f} ms and data wait {1e3 * self.extra_data_s:+.1f} ms; the others wait "
            f"{1e3 * self.others_wait_s:.1f} ms per step in collectives"
        )

    def fields(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


def judge(splits: Sequence[Split], step: int, factor: float, min_excess_s: float) -> list[Straggler]:
    """The ranks of ``splits`` (one per rank) slower than ``factor`` x the others' median own time."""
    found = []
    for rank, mine in enumerate(splits):
        others = [s for r, s in enumerate(splits) if r != rank]
        if not others:
            return []
        median_own = statistics.median(s.own_s for s in others)
        if mine.own_s <= factor * median_own or mine.own_s - median_own < min_excess_s:
            continue
        found.append(
            Straggler(
                rank,
                step,
                mine.own_s / median_own if median_own > 0 else float("inf"),
                mine.own_s,
                median_own,
                mine.compute_s - statistics.median(s.compute_s for s in others),
                mine.data_s - statistics.median(s.data_s for s in others),
                statistics.median(s.wait_s for s in others),
            )
        )
    return found


class CollectiveWait:
    """Times each step's wait in collectives on this rank: from the backward's last gradient to the update.

    Hooks: one global optimizer pre-step hook, and, on the parameters of each optimizer seen, a post-accumulate-grad
    hook; after the first backward only the hook of the parameter whose gradient came last is kept (one call per
    backward). A parameter that gets no gradient in some step leaves that step's wait unmeasured (0).
    """

    def __init__(self) -> None:
        self.wait_s = 0.0
        self._last_grad: float | None = None
        self._last_index = -1
        self._seen: set[int] = set()
        self._grad_hooks: list[Any] = []
        self._pruned = True
        self._hooks = [register_optimizer_step_pre_hook(self._optimizer), before_update(self._update)]

    def _optimizer(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if id(optimizer) in self._seen:
            return
        self._seen.add(id(optimizer))
        for group in optimizer.param_groups:
            for param in group["params"]:
                if isinstance(param, torch.Tensor) and param.requires_grad and param.is_leaf:
                    index = len(self._grad_hooks)
                    self._grad_hooks.append(param.register_post_accumulate_grad_hook(lambda _, i=index: self._grad(i)))
        self._pruned = False

    def _grad(self, index: int) -> None:
        self._last_grad = time.perf_counter()
        self._last_index = index

    def _update(self) -> None:
        if self._last_grad is not None:
            self.wait_s += time.perf_counter() - self._last_grad
            self._last_grad = None
        if not self._pruned and self._last_index >= 0:  # keep the hook of the gradient that came last
            for index, hook in enumerate(self._grad_hooks):
                if index != self._last_index and hook is not None:
                    hook.remove()
                    self._grad_hooks[index] = None
            self._pruned = True

    def take(self) -> float:
        waited, self.wait_s = self.wait_s, 0.0
        return waited

    def close(self) -> None:
        for hook in [*self._hooks, *self._grad_hooks]:
            if hook is not None:
                hook.remove()
        self._grad_hooks = []


class SlowDrill:
    """The ``slow=FACTOR`` drill of this rank: from its step on, a sleep at each boundary of ``FACTOR - 1`` times the
    step's own time (its time less the drill's last sleep), so the rank's steps take ``FACTOR`` times as long.

    ``start_step``: where this run's training began. A run resumed at step S (its first boundary is S + 1) skips a
    drill due at S or before: it happened in the run that was there. A fresh run (S = 0) takes ``step=0`` too.
    """

    def __init__(self, injections: Sequence[Injection], rank: int, start_step: int = 0):
        self.rank = rank
        mine = sorted((i for i in injections if i.fault == SLOW and i.rank in (None, rank)), key=lambda i: i.step)
        self.pending = due_in_this_run(mine, start_step + 1 if start_step else 0, rank)
        self.factor: float | None = None
        self._slept = 0.0

    def at_boundary(self, step: int, step_s: float) -> None:
        if self.pending and self.pending[0].step <= step:
            injection = self.pending.pop(0)
            self.factor = injection.factor
            log.warning("rank %d: injecting %s at step %d (straggler drill)", self.rank, injection, step)
        if self.factor is None:
            return
        self._slept = (self.factor - 1) * max(0.0, step_s - self._slept)
        time.sleep(self._slept)


class SessionStragglers:
    """The training session's part in stragglers: the drill, the measures, the comparison every window.

    Args:
        manager: Its control group carries the comparison; its rank and world size.
        emit: Where this rank's split and the slowest rank go, each window.
        record: Writes a straggler (or its replacement) to the goodput ledger: ``record(kind, **fields)``.
        data_wait: This rank's data wait so far, in seconds.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        emit: Callable[[dict[str, float]], None],
        record: Callable[..., None],
        data_wait: Callable[[], float],
    ) -> None:
        self._manager = manager
        self._emit = emit
        self._record = record
        self._data_wait = data_wait
        self.config: StragglerConfig | None = None
        self._drill: SlowDrill | None = None
        self._waits: CollectiveWait | None = None
        self._last: float | None = None
        self._sums = [0.0, 0.0, 0.0, 0]  # step, data wait, collective wait seconds; steps
        self._data_seen = 0.0
        self._streaks: dict[int, int] = {}

    def use(self, config: StragglerConfig) -> None:
        self.config = config

    def start(self, step: int, injections: Sequence[Injection]) -> None:
        """Training begins at ``step``: the drill of this rank (if any) and, with the comparison on, the measures."""
        self._drill = SlowDrill(injections, self._manager.rank, step)
        if self.config is not None and self.config.enabled and self._manager.world_size > 1:
            self._waits = CollectiveWait()
        self._data_seen = self._data_wait()
        self._last = time.perf_counter()

    def at_boundary(self, step: int, now: float) -> None:
        """At each step boundary, with the time it began: the drill's sleep, the sums, and every ``window`` steps the
        comparison (collective)."""
        if self._last is None:
            return
        step_s, self._last = now - self._last, now
        if self._drill is not None:
            self._drill.at_boundary(step, step_s)
        if self._waits is None:
            return
        assert self.config is not None
        data = self._data_wait()
        self._sums[0] += step_s
        self._sums[1] += data - self._data_seen
        self._sums[2] += self._waits.take()
        self._sums[3] += 1
        self._data_seen = data
        if step % self.config.window == 0:
            self._compare(step)

    def _compare(self, step: int) -> None:
        assert self.config is not None
        step_s, data_s, wait_s, steps = self._sums
        self._sums = [0.0, 0.0, 0.0, 0]
        rows = self._manager.groups.control.all_gather((step_s, data_s, wait_s, steps))
        splits = [Split(s / max(1, n), d / max(1, n), w / max(1, n)) for s, d, w, n in rows]
        slow = judge(splits, step, self.config.factor, self.config.min_excess_s)
        self._streaks = {s.rank: self._streaks.get(s.rank, 0) + 1 for s in slow}
        named = [s for s in slow if self._streaks[s.rank] == self.config.windows]
        mine = splits[self._manager.rank]
        slowest = max(range(len(splits)), key=lambda r: splits[r].own_s)
        others = [s.own_s for r, s in enumerate(splits) if r != slowest]
        self._emit(
            {
                "stragglers/step_s": mine.step_s,
                "stragglers/compute_s": mine.compute_s,
                "stragglers/data_wait_s": mine.data_s,
                "stragglers/collective_wait_s": mine.wait_s,
                "stragglers/slowest_rank": float(slowest),
                "stragglers/slowest_ratio": splits[slowest].own_s / max(1e-9, statistics.median(others)),
                "stragglers/slow_ranks": float(sum(1 for r in self._streaks.values() if r >= self.config.windows)),
            }
        )
        for straggler in named:
            if self._manager.rank == 0:
                log.warning("at step %d: %s", step, straggler.describe())
            self._record("straggler", **straggler.fields())
        if named and self.config.replace:
            if inplace.active():
                self._replace(named[0])
            elif self._manager.rank == 0:
                log.warning("%sREPLACE is set, but only resilience launch has spares: not replaced", ENV_PREFIX)

    def _replace(self, straggler: Straggler) -> None:
        """End the straggler the way a hung rank is ended: the launcher kills it, the others' next collective
        fails, they save and restart in place, and a warm spare takes its rank."""
        self._record("straggler_replaced", rank=straggler.rank, step=straggler.step)
        if self._manager.rank != straggler.rank:
            return
        log.warning("rank %d: a straggler; asking the launcher to replace it with a spare", straggler.rank)
        inplace.evict([straggler.rank])
        time.sleep(EVICTED_WAIT_S)
        raise RuntimeError(f"rank {straggler.rank} asked to be replaced as a straggler, but was not ended")

    def close(self) -> None:
        if self._waits is not None:
            self._waits.close()
            self._waits = None
