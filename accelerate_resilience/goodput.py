"""The goodput pieces the handle drives: data-wait figures of the training loader, and the ``"auto"`` interval.

Both are the engine's (:mod:`resilience.goodput`); what is particular to Accelerate is where time is measured.
The prepared loader runs the handle's per-batch hook inside the ``next()`` that a timed loader measures, and
the interval must be the same on every rank although each rank measures its own costs.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from accelerate_resilience.plugin import ResiliencePlugin
from resilience.goodput import AdaptiveInterval, DataWaitMonitor, DataWindow, GoodputLedger, IntervalPlan

# With "auto", the first save comes this many steps in: it measures what a save costs.
AUTO_FIRST_SAVE_STEPS = 5


class LoaderMonitor(DataWaitMonitor):
    """The data-wait monitor of :meth:`ResilienceHandle.timed`, with the handle's own hook time left out.

    Accelerate's loader calls the handle's per-batch hook (interval and emergency saves, the health
    all-reduce, tracker logging) inside the ``next()`` that :class:`~resilience.goodput.TimedIterator` times.
    That time is checkpoint stall or bookkeeping, already accounted by the handle: counted as data wait too,
    a save would show as starvation and be counted twice in the ledger.
    """

    def __init__(
        self,
        plugin: ResiliencePlugin,
        rank: int,
        ledger: GoodputLedger,
        on_window: Callable[[DataWindow], None],
    ) -> None:
        super().__init__(
            int(plugin.data_window_steps or 0), float(plugin.starvation_threshold or 0), rank=rank, on_window=on_window
        )
        self.ledger = ledger
        self._hook_s = 0.0  # hook time inside the fetch in progress
        self._fetch_hook_s = 0.0  # hook time inside the last finished fetch, until its step is recorded

    def hook_ran(self, seconds: float) -> None:
        self._hook_s += seconds

    def fetched(self, wait_s: float) -> None:
        """TimedIterator's ``on_wait``: one ``next()`` returned after ``wait_s``."""
        self._fetch_hook_s, self._hook_s = self._hook_s, 0.0
        self.ledger.data_wait(max(0.0, wait_s - self._fetch_hook_s))

    def record(self, wait_s: float, step_s: float, samples: int = 0) -> DataWindow | None:
        self._hook_s = 0.0  # a fetch begins: hook time from outside a timed fetch is not this one's
        return super().record(max(0.0, wait_s - self._fetch_hook_s), step_s, samples)


class AutoInterval:
    """``every_n_steps="auto"``: the main process plans from what it measured, and every rank follows its plan.

    Each rank measures its own save costs and step times, so plans made on each rank could differ and the
    ranks would then save (collectively) at different steps and hang. :meth:`replan` runs on every rank at
    the same step, right after a save, and broadcasts the main process's plan.
    """

    def __init__(self, plugin: ResiliencePlugin, accelerator: Accelerator, run_dir: str) -> None:
        self.accelerator = accelerator
        self.planner = AdaptiveInterval(
            mtbf_s=None if plugin.mtbf_hours is None else plugin.mtbf_hours * 3600.0,
            world_size=accelerator.num_processes,
            min_s=float(plugin.min_interval_s or 0),
            max_s=float(plugin.max_interval_s or 0),
        )
        if accelerator.is_main_process:  # earlier incarnations' failures give the observed MTBF
            self.planner.observe_ledger(run_dir)
        self.plan: IntervalPlan | None = None
        self.interval_steps = AUTO_FIRST_SAVE_STEPS
        self.next_step = AUTO_FIRST_SAVE_STEPS
        self._step_times: deque[float] = deque(maxlen=50)
        self._last_step_t: float | None = None
        self._saves = 0
        self._blocked_s = 0.0

    def start(self, step: int, now: float) -> None:
        self.next_step = step + AUTO_FIRST_SAVE_STEPS
        self._last_step_t = now

    def step_done(self, now: float) -> None:
        if self._last_step_t is not None:
            self._step_times.append(now - self._last_step_t)
        self._last_step_t = now

    def blocked(self, seconds: float, saves: int) -> None:
        """Training blocked ``seconds`` for checkpoints (``saves`` new saves, or a later staging wait)."""
        self._blocked_s += seconds
        self._saves += saves

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def replan(self, step: int, now: float) -> IntervalPlan:
        """Collective. ``now``: when the save ended, so that its time is not taken for a step's."""
        plan = None
        if self.accelerator.is_main_process:
            if self._saves:
                self.planner.observe_cost(self._blocked_s / self._saves)
            plan = self.planner.plan(step_s=statistics.median(self._step_times) if self._step_times else None)
        self._saves, self._blocked_s = 0, 0.0
        self.plan = broadcast_object_list([plan])[0]
        assert self.plan is not None
        self.interval_steps = self.plan.interval_steps or AUTO_FIRST_SAVE_STEPS
        self.next_step = step + self.interval_steps
        self._last_step_t = now
        return self.plan

    def metrics(self) -> dict[str, float]:
        """The plan for the trackers: the interval in steps, and what it is expected to cost."""
        assert self.plan is not None
        return self.plan.metrics(self.interval_steps)
