"""The data-wait monitor against real DataLoaders: measured fraction, starvation warning, and its named cause."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from resilience.goodput import DataWaitMonitor, GoodputLedger, TimedIterator, describe_loader, summarize
from resilience.goodput.data import DataWindow, LoaderInfo, diagnose

ITEM_S = 0.01  # per sample, in __getitem__
BATCH = 2
COMPUTE_S = 0.06  # per step


class SlowDataset(Dataset[torch.Tensor]):
    """Sleeps per sample, and keeps how long the sleeps really took (a busy machine wakes sleepers late)."""

    def __init__(self, n: int, item_s: float) -> None:
        self.n, self.item_s = n, item_s
        self.slept = 0.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        t0 = time.perf_counter()
        time.sleep(self.item_s)
        self.slept += time.perf_counter() - t0
        return torch.full((4,), float(index))


def test_slow_loader_reports_starvation_and_the_injected_wait_fraction(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    dataset = SlowDataset(40, ITEM_S)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=0)
    windows: list[DataWindow] = []
    monitor = DataWaitMonitor(window_steps=5, threshold=0.05, on_window=windows.append)
    assert monitor.watch(loader).num_workers == 0
    ledger = GoodputLedger(tmp_path, process_start=time.time())
    ledger.startup_done()
    samples = 0
    with caplog.at_level(logging.WARNING, logger="resilience.goodput.data"):
        started = time.perf_counter()
        for step, batch in enumerate(TimedIterator(loader, monitor, on_wait=ledger.data_wait), start=1):
            samples += batch.shape[0]
            time.sleep(COMPUTE_S)
            ledger.step_end(step)
        loop_s = time.perf_counter() - started
    ledger.end()

    assert len(windows) == 4 and sum(w.steps for w in windows) == 20 and sum(w.samples for w in windows) == samples
    waited = sum(w.wait_s for w in windows)
    measured = waited / sum(w.step_s for w in windows)
    # The dataset's sleeps (as long as they really took) all happen inside next(); the rest of a fetch
    # (the sampler, collation) adds a little. The compute is not waiting: counted, it would add 20 steps of
    # COMPUTE_S. Absolute times, so a loaded machine's late wake-ups shift neither bound.
    assert dataset.slept <= waited < dataset.slept + COMPUTE_S
    assert all(w.starving and w.cause == "workers" for w in windows)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings  # repeated at most every warn_every_s, not every window
    assert "num_workers=0" in warnings[0] and "(workers)" in warnings[0]
    metrics = windows[0].metrics()
    assert metrics["data/wait_fraction"] == windows[0].wait_fraction and metrics["data/starving"] == 1.0
    assert metrics["data/samples_per_s"] == windows[0].samples / windows[0].step_s
    assert sum(w.step_s for w in windows) == pytest.approx(loop_s, rel=0.05)  # every step, once
    assert metrics["data/collate_ms_per_step"] < 5  # default_collate of two small tensors: not the cause
    # The same waits reached the ledger's data-wait bucket.
    ledger_fraction = summarize(tmp_path).buckets["data_wait"] / sum(w.step_s for w in windows)
    assert ledger_fraction == pytest.approx(measured, rel=0.05)


def test_slow_collate_in_process_is_named(caplog: pytest.LogCaptureFixture) -> None:
    def slow_collate(items: list[torch.Tensor]) -> Any:
        time.sleep(0.01)
        return default_collate(items)

    loader = DataLoader(SlowDataset(8, 0.0), batch_size=2, collate_fn=slow_collate)
    monitor = DataWaitMonitor(window_steps=4)
    monitor.watch(loader)
    with caplog.at_level(logging.WARNING, logger="resilience.goodput.data"):
        for _ in TimedIterator(loader, monitor):
            time.sleep(0.005)
    assert monitor.last is not None and monitor.last.cause == "collate"
    assert monitor.last.collate_s is not None and monitor.last.collate_s >= 4 * 0.01
    assert "collate_fn takes" in caplog.records[0].getMessage()


def test_fast_loader_is_not_starving(caplog: pytest.LogCaptureFixture) -> None:
    monitor = DataWaitMonitor(window_steps=10, threshold=0.05)
    with caplog.at_level(logging.WARNING, logger="resilience.goodput.data"):
        for _ in range(10):
            window = monitor.record(0.001, 0.1, 32)
    assert window is not None and not window.starving and window.cause is None
    assert window.metrics()["data/samples_per_s"] == pytest.approx(320.0)
    assert not caplog.records


def test_describe_loader_reads_the_settings_that_matter() -> None:
    loader = DataLoader(
        SlowDataset(4, 0.0), batch_size=2, num_workers=2, pin_memory=True, prefetch_factor=4, persistent_workers=True
    )
    info = describe_loader(loader)
    assert info == LoaderInfo(num_workers=2, pin_memory=True, prefetch_factor=4, persistent_workers=True, batch_size=2)
    monitor = DataWaitMonitor()
    monitor.watch(loader)
    assert loader.collate_fn is default_collate  # runs in the workers: left alone


def _window(wait_s: float, max_wait_s: float, steps: int = 10) -> DataWindow:
    return DataWindow(0, steps, wait_s, 1.0, 320, max_wait_s, None, 0.05)


@pytest.mark.parametrize(
    ("info", "max_wait", "cause"),
    [
        (LoaderInfo(num_workers=4, persistent_workers=True, prefetch_factor=2), 0.03, "io"),
        (LoaderInfo(num_workers=4, persistent_workers=False), 0.25, "worker_startup"),
        (LoaderInfo(num_workers=4, persistent_workers=True), 0.25, "io"),
        (None, 0.03, "unknown"),
    ],
)
def test_causes_with_workers(info: LoaderInfo | None, max_wait: float, cause: str) -> None:
    found, advice = diagnose(_window(0.3, max_wait), info)
    assert found == cause and advice
