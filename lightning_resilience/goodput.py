"""``GoodputMonitor``: where the run's time goes (across restarts), data starvation, checkpoint telemetry."""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from lightning_resilience.session_callback import SessionCallback
from resilience.docstrings import documented_by
from resilience.goodput import GoodputConfig
from resilience.session import TrainingSession


@documented_by(GoodputConfig, notes={"run_dir": "Default: ``trainer.default_root_dir``."})
class GoodputMonitor(SessionCallback):
    """Keeps the goodput ledger of the run and logs data-wait and checkpoint metrics to every logger.

    Lightning has no hook around the data loader's ``next()``; the time between one step's end and the next
    step's start is the fetch and host-to-device copy plus whatever callbacks and validation did in between.
    The session counts that gap, less the time saves blocked and validation took, as data wait.
    ``resilience report RUN_DIR`` reads the ledger.

    Args:
        run_dir: Where the ledger lives (``<run_dir>/goodput/``); it must outlive a restart, and on several nodes be
            on a shared file system. Only the main process writes it. Default: ``trainer.default_root_dir``.
        window_steps: Steps per data-wait window (one metrics row and at most one starvation warning each).
        starvation_threshold: Fraction of step time spent waiting for data above which the accelerator starves.
        span_s: How often the ledger writes what it has summed up as a span; between spans the pending one is kept
            in a side file at each step's end, so a kill loses only the time since the last step ended (it then
            shows as downtime).
    """

    def __init__(
        self,
        run_dir: str | None = None,
        window_steps: int = 50,
        starvation_threshold: float = 0.05,
        span_s: float = 10.0,
    ) -> None:
        self.run_dir = run_dir
        self.window_steps = window_steps
        self.starvation_threshold = starvation_threshold
        self.span_s = span_s

    def configure(self, session: TrainingSession, trainer: pl.Trainer) -> None:
        run_dir = self.run_dir or trainer.default_root_dir
        session.use_goodput(GoodputConfig(run_dir, self.span_s, self.window_steps, self.starvation_threshold))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        loader = trainer.train_dataloader
        if self._session is not None and self._session.data is not None and hasattr(loader, "num_workers"):
            # a starvation warning names its cause from the loader's settings (workers, pinning, prefetching);
            # its collate_fn is not timed: the epoch's iterator, made before this hook, holds the one it had
            self._session.data.watch(loader, time_collate=False)
