"""Is the accelerator waiting for data, and why.

Only the time the training loop blocks in ``next()`` on the loader counts: loading that overlaps the step
(workers, prefetching) costs nothing. Above a few percent of step time the accelerator starves; the monitor
then names the most likely cause from what it can see cheaply: the loader's settings, the shape of the
waits (steady or one long stall), and the time spent in ``collate_fn`` when it runs in this process.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class LoaderInfo:
    """The DataLoader settings that decide whether loading overlaps the step (None: not a DataLoader field)."""

    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    batch_size: int | None = None

    def settings(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.__dict__.items() if value is not None)


def describe_loader(loader: Any) -> LoaderInfo:
    """Read a DataLoader's (or look-alike's: Accelerate's shards, torchdata's StatefulDataLoader) settings."""
    return LoaderInfo(
        num_workers=getattr(loader, "num_workers", None),
        pin_memory=getattr(loader, "pin_memory", None),
        prefetch_factor=getattr(loader, "prefetch_factor", None),
        persistent_workers=getattr(loader, "persistent_workers", None),
        batch_size=getattr(loader, "batch_size", None),
    )


class TimedCollate:
    """Wraps a ``collate_fn`` to sum its time; meaningful only where it runs in this process (no workers)."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn
        self.total_s = 0.0

    def __call__(self, batch: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.collate_fn(batch)
        finally:
            self.total_s += time.perf_counter() - start


@dataclass(frozen=True)
class DataWindow:
    """Data-loading figures of one window of steps on one rank."""

    rank: int
    steps: int
    wait_s: float
    step_s: float
    samples: int
    max_wait_s: float
    collate_s: float | None
    threshold: float
    cause: str | None = None
    advice: str | None = None

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def starving(self) -> bool:
        return self.wait_fraction > self.threshold

    def metrics(self, prefix: str = "data/") -> dict[str, float]:
        """Numbers for Lightning loggers and Accelerate trackers."""
        out = {
            "wait_fraction": self.wait_fraction,
            "wait_ms_per_step": 1e3 * self.wait_s / self.steps,
            "step_ms": 1e3 * self.step_s / self.steps,
            "samples_per_s": self.samples / self.step_s if self.step_s > 0 else 0.0,
            "starving": float(self.starving),
        }
        if self.collate_s is not None:
            out["collate_ms_per_step"] = 1e3 * self.collate_s / self.steps
        return {prefix + name: value for name, value in out.items()}


def diagnose(window: DataWindow, loader: LoaderInfo | None) -> tuple[str, str]:
    """The likely cause of a starving window (``collate``, ``workers``, ``worker_startup``, ``io``, ``unknown``)."""
    per_step_ms = 1e3 * window.wait_s / window.steps
    if window.collate_s is not None and window.collate_s >= 0.5 * window.wait_s:
        return "collate", (
            f"collate_fn takes {1e3 * window.collate_s / window.steps:.1f} ms of the {per_step_ms:.1f} ms wait per "
            "step in the training process: make it cheaper, or move the work into the dataset and use workers"
        )
    settings = f" ({loader.settings()})" if loader else ""
    if loader is not None and loader.num_workers == 0:
        return "workers", (
            f"the DataLoader has num_workers=0{settings}, so every batch is read and collated in the training "
            "process while the accelerator waits: set num_workers (a few per accelerator) and persistent_workers=True"
        )
    if window.steps >= 4 and window.max_wait_s >= 0.5 * window.wait_s:
        if loader is not None and loader.persistent_workers is False:
            return "worker_startup", (
                f"one stall of {window.max_wait_s:.2f} s holds most of the wait{settings}: workers are restarted "
                "for every epoch; set persistent_workers=True"
            )
        return "io", (
            f"one stall of {window.max_wait_s:.2f} s holds most of the wait{settings}: a slow read (storage, a "
            "remote shard) or a slow sample; check the I/O path"
        )
    if loader is not None and loader.num_workers:
        return "io", (
            f"{loader.num_workers} workers do not keep up{settings}: loading a batch takes longer than a step. "
            "If CPU cores are idle the bottleneck is I/O (storage throughput, decoding); else add workers or raise "
            "prefetch_factor"
        )
    return "unknown", (
        f"{per_step_ms:.1f} ms wait per step, from a loader whose settings could not be read (not a torch "
        "DataLoader, or several): check its workers and its reads"
    )


class DataWaitMonitor:
    """Per-rank data-wait fraction and throughput per window of steps, with a warning when starving.

    Args:
        window_steps: Steps per window (one metrics dict and at most one warning each).
        threshold: Wait fraction of step time above which the accelerator counts as starving.
        rank: Named in warnings and in :class:`DataWindow`, so the worst rank can be picked out.
        warn_every_s: Repeat the warning at most this often while starving goes on.
        on_window: Called with each finished window (from the training thread).
    """

    # The window being filled; reset by _reset().
    _wait: float
    _step: float
    _max_wait: float
    _samples: int
    _steps: int

    def __init__(
        self,
        window_steps: int = 50,
        threshold: float = 0.05,
        *,
        rank: int = 0,
        warn_every_s: float = 600.0,
        on_window: Callable[[DataWindow], None] | None = None,
    ) -> None:
        if window_steps < 1 or not 0 < threshold < 1:
            raise ValueError(f"window_steps={window_steps}, threshold={threshold}: use >= 1 and a fraction in (0, 1)")
        self.window_steps = window_steps
        self.threshold = threshold
        self.rank = rank
        self.warn_every_s = warn_every_s
        self.on_window = on_window
        self.loader: LoaderInfo | None = None
        self.last: DataWindow | None = None
        self._collate: TimedCollate | None = None
        self._collate_mark = 0.0
        self._last_warning = -float("inf")
        self._reset()

    def watch(self, loader: Any, *, time_collate: bool = True) -> LoaderInfo:
        """Learn the loader's settings; with no workers, also time its ``collate_fn`` (wrapped in place)."""
        self.loader = describe_loader(loader)
        self._collate = None
        collate = getattr(loader, "collate_fn", None)
        if time_collate and self.loader.num_workers == 0 and callable(collate):
            timed = collate if isinstance(collate, TimedCollate) else TimedCollate(collate)
            try:
                loader.collate_fn = timed
                self._collate = timed
            except (AttributeError, ValueError) as exc:
                log.debug("cannot time collate_fn of %r: %s", type(loader).__name__, exc)
        self._collate_mark = self._collate.total_s if self._collate else 0.0
        return self.loader

    def record(self, wait_s: float, step_s: float, samples: int = 0) -> DataWindow | None:
        """One step: ``wait_s`` blocked in ``next()``, ``step_s`` from one fetch to the next (wait included).

        Returns the window when this step completes one.
        """
        self._wait += wait_s
        self._step += step_s
        self._samples += samples
        if wait_s > self._max_wait:
            self._max_wait = wait_s
        self._steps += 1
        if self._steps < self.window_steps:
            return None
        return self._finish()

    def _finish(self) -> DataWindow:
        collate_s = None
        if self._collate is not None:
            collate_s = self._collate.total_s - self._collate_mark
            self._collate_mark = self._collate.total_s
        window = DataWindow(
            self.rank, self._steps, self._wait, self._step, self._samples, self._max_wait, collate_s, self.threshold
        )
        if window.starving:
            cause, advice = diagnose(window, self.loader)
            window = dataclasses.replace(window, cause=cause, advice=advice)
            now = time.monotonic()
            if now - self._last_warning >= self.warn_every_s:
                self._last_warning = now
                log.warning(
                    "rank %d: the accelerator waits for data %.1f%% of step time over the last %d steps "
                    "(threshold %.1f%%). Likely cause (%s): %s",
                    self.rank,
                    100 * window.wait_fraction,
                    window.steps,
                    100 * self.threshold,
                    cause,
                    advice,
                )
        self.last = window
        self._reset()
        if self.on_window is not None:
            self.on_window(window)
        return window

    def _reset(self) -> None:
        self._wait = self._step = self._max_wait = 0.0
        self._samples = self._steps = 0


def batch_size_of(batch: Any) -> int:
    """Leading size of the first tensor-like found in a batch (tensors, mappings, sequences), else 1."""
    while True:
        if isinstance(batch, (list, tuple)):
            if not batch:
                return 1
            batch = batch[0]
        elif isinstance(batch, dict):
            if not batch:
                return 1
            batch = next(iter(batch.values()))
        else:
            shape = getattr(batch, "shape", None)
            return int(shape[0]) if shape else 1


class WaitRecorder(Protocol):
    """What :class:`TimedIterator` reports each step to (a :class:`DataWaitMonitor`, or a wrapper of one)."""

    def record(self, wait_s: float, step_s: float, samples: int = 0) -> object: ...


class TimedIterator(Generic[T]):
    """Iterates like ``iterable`` and times each ``next()``; a step is recorded once the next fetch begins.

    One step runs from one fetch to the next, so the recorded step time includes its own wait and the
    compute after it. ``on_wait`` gets each wait as it is measured (e.g. :meth:`GoodputLedger.data_wait`).
    """

    def __init__(
        self,
        iterable: Iterable[T],
        monitor: WaitRecorder,
        *,
        on_wait: Callable[[float], None] | None = None,
        count: Callable[[Any], int] = batch_size_of,
    ) -> None:
        self.iterable = iterable
        self.monitor = monitor
        self.on_wait = on_wait
        self.count = count

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        """Loader attributes (``dataset``, ``set_epoch``, ...) pass through, so the wrapper can stand in for it."""
        if name == "iterable":  # not set yet (copy, unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.iterable, name)

    def __iter__(self) -> Iterator[T]:
        clock, record, on_wait, count = time.perf_counter, self.monitor.record, self.on_wait, self.count
        iterator = iter(self.iterable)
        previous: tuple[float, float, int] | None = None
        while True:
            called = clock()
            if previous is not None:
                record(previous[1], called - previous[0], previous[2])
            try:
                batch = next(iterator)
            except StopIteration:
                return
            wait = clock() - called
            if on_wait is not None:
                on_wait(wait)
            previous = (called, wait, count(batch))
            yield batch
