"""``PeriodicCheckpoint``: save every N steps, or every ``"auto"`` steps from Young/Daly."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_resilience.session_callback import SessionCallback
from resilience.docstrings import documented_by
from resilience.goodput import IntervalConfig, IntervalPlan
from resilience.session import TrainingSession


@documented_by(
    IntervalConfig, own={"every_n_steps": 'Steps between saves, or ``"auto"`` for the interval that wastes least.'}
)
class PeriodicCheckpoint(SessionCallback):
    """Saves at a fixed step interval, or at the one that wastes least; each save is a full engine checkpoint.

    With ``every_n_steps="auto"`` the interval is about ``sqrt(2 * C * MTBF)`` (Young/Daly), where ``C`` is the
    measured time a save blocks training (asynchronous staging's wait before the next optimizer step included)
    and MTBF is given, observed from the run's restarts in its goodput ledger, or a prior per GPU; it is clamped
    to ``[min_interval_s, max_interval_s]`` and turned into steps with the measured step time. Rank 0 plans and
    every rank follows, so all save at the same step. The plan is logged after each save; it is kept in the
    checkpoint (also in one saved after ``fit()``), so a resumed run goes on with it instead of measuring again.
    The saves make no ``.ckpt`` name (``ModelCheckpoint`` does that); ``AutoResume`` and ``resilience ls`` see
    them.

    Args:
        every_n_steps: Steps between saves, or ``"auto"`` for the interval that wastes least.
        mtbf_hours: With ``"auto"``: the job's mean time between failures, if known; else observed from the run's
            restarts in its goodput ledger, else a prior of 5.8 GPU-years per GPU.
        min_interval_s: With ``"auto"``: the shortest interval it may choose.
        max_interval_s: With ``"auto"``: the longest interval it may choose.
        warmup_steps: With ``"auto"``: the first save comes this many steps in, to measure what a save costs.
    """

    def __init__(
        self,
        every_n_steps: int | Literal["auto"] = "auto",
        mtbf_hours: float | None = None,
        min_interval_s: float = 60.0,
        max_interval_s: float = 6 * 3600.0,
        warmup_steps: int = 5,
    ) -> None:
        self.config = IntervalConfig(every_n_steps, mtbf_hours, min_interval_s, max_interval_s, warmup_steps)
        self._restored: dict[str, Any] | None = None
        self._kept_plan: IntervalPlan | None = None
        self._kept_state: dict[str, Any] = {}

    def configure(self, session: TrainingSession, trainer: pl.Trainer) -> None:
        session.use_interval(self.config)

    @property
    def last_plan(self) -> dict[str, Any] | None:
        """The last ``"auto"`` plan (interval, cost, MTBF and what they came from); still there after the fit."""
        plan = self._session.last_plan if self._session is not None else self._kept_plan
        return plan.to_dict() if plan is not None else None

    def keep_after_fit(self, session: TrainingSession) -> None:
        """A save after the fit keeps the plan, so a run resumed from it goes on with it."""
        self._kept_plan, self._kept_state = session.last_plan, session.interval_state()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._session is not None and self._restored is not None:
            self._session.load_interval_state(self._restored)
        super().on_train_start(trainer, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._session.interval_state() if self._session is not None else dict(self._kept_state)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
