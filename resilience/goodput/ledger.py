"""Where a training process's wall time goes, written as it happens so the account survives kills and restarts.

The process is always inside exactly one *period*. A boundary call (:meth:`GoodputLedger.startup_done`,
:meth:`~GoodputLedger.step_begin`, :meth:`~GoodputLedger.step_end`, :meth:`~GoodputLedger.end`) closes the
period and gives its time to one bucket, minus the measured pieces reported inside it (data wait, checkpoint
stall, restore, emergency handling). Every second is counted once, so an incarnation's buckets add up to its
lifetime by construction.

Periods are summed in memory and written as one ``span`` line about every ``span_s`` seconds. Between spans,
``step_end`` writes the span it would write now over the previous one in a small side file (one ``pwrite``,
no fsync; at most every 10 ms): a ``kill -9`` between spans would otherwise take the steps and the time since
the last span with it, and the report would put the kill at a step long past (one run killed at step 46 read
as "reached 9", with nothing redone). Only rank 0 writes: ranks move in lockstep through collectives, so one
clock describes the job, and per-rank data wait goes to metrics instead (see :mod:`resilience.goodput.data`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

LEDGER_DIR = "goodput"
FORMAT_VERSION = 1
# Buckets a running process fills; the summary adds "lost" (reclassified productive time) and "downtime".
# A restore's parts (CheckpointManager.load's timings): listing the tiers, checksums, the read itself.
LOAD_PARTS = ("discover_s", "verify_s", "read_s")
PROCESS_BUCKETS = ("productive", "data_wait", "checkpoint", "restore", "startup", "emergency", "other")
COMPLETED = "completed"
PENDING_SUFFIX = ".pending.json"  # incarnation-NNNNNN.pending.json: the span not yet in the .jsonl file
_PENDING_BYTES = 512  # each pending span is padded to this, so a shorter one leaves nothing of a longer one
# The pending span is written at a step's end at most this often: every step of 10 ms or longer, and no more than
# 100 writes a second (each about 5 us) for shorter steps, whose last 10 ms a kill may then take with it.
PENDING_EVERY_S = 0.01


def ledger_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / LEDGER_DIR


def pending_path(ledger_file: str | os.PathLike[str]) -> Path:
    """The side file holding ``ledger_file``'s pending span (written between spans, removed at ``end()``)."""
    path = Path(ledger_file)
    return path.with_name(path.name.removesuffix(".jsonl") + PENDING_SUFFIX)


def process_start_time() -> float | None:
    """Unix time this process started (Linux), so interpreter and import time count as startup."""
    try:
        with open("/proc/self/stat") as handle:
            # The command name may hold spaces and parentheses; fields after the last ')' are fixed.
            started = int(handle.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        # Both counted from boot; the kernel's boot time in /proc/stat is whole seconds, too coarse.
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, IndexError, ValueError, AttributeError):
        return None


_UNACCOUNTED = "unaccounted"
_process_accounted: str | None = _UNACCOUNTED  # the generation whose start-up a ledger of this process counted


def incarnation_start() -> float | None:
    """Where a new incarnation's account begins: at the process's start for the first ledger of a process (the
    interpreter and imports count as startup), now for a later one (a second ``fit()`` in the same process).

    Under ``resilience launch`` a process may begin a generation later than it started (a warm spare given a
    rank, a survivor running its script again): its first ledger of a generation begins then."""
    global _process_accounted
    generation = os.environ.get("RESILIENCE_GENERATION")  # resilience.recovery.inplace.ENV_GENERATION
    first, _process_accounted = _process_accounted != generation, generation
    if not first:
        return time.time()
    began = float(os.environ.get("RESILIENCE_GENERATION_BEGAN") or 0.0)  # resilience.recovery.inplace.ENV_BEGAN
    started = process_start_time()
    return max(began, started) if started is not None else (began or None)


class GoodputLedger:
    """Accounts the wall time of one incarnation (one process lifetime) of a training run.

    Args:
        run_dir: Directory shared by every incarnation of the run (the checkpoint directory is a good
            choice); events go to ``<run_dir>/goodput/incarnation-<NNNNNN>.jsonl``.
        rank: Only rank 0 writes unless ``write`` says otherwise; other ranks keep the in-memory account.
        span_s: How often accumulated periods are written as a span (seconds of wall time). Between spans the
            pending one is kept in a side file at each ``step_end`` (at most every 10 ms), so a kill loses only
            the time since the last step ended (it then shows as downtime), or the last 10 ms of steps shorter
            than that; where the side file cannot be written, up to ``span_s``.
        process_start: Unix time the incarnation began (default: this process's start, else now).
        write: Whether this instance writes the file (default: ``rank == 0``).
        clock: Monotonic clock in seconds (a test passes a fake one).
        wall: Unix clock, used only to place the incarnation in time.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        rank: int = 0,
        *,
        span_s: float = 10.0,
        process_start: float | None = None,
        write: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.rank = rank
        self.span_s = span_s
        self._clock = clock
        now, wall_now = clock(), wall()
        start = process_start if process_start is not None else process_start_time()
        start = wall_now if start is None else min(start, wall_now)
        self._perf_ref, self._wall_ref = now, wall_now
        self._mark = now - (wall_now - start)
        self._start = self._span_t0 = self._mark
        self._wait = 0.0  # data wait, apart from the other pieces: it comes every step
        self._carved: dict[str, float] = {}
        self._residual = "startup"
        self._acc = dict.fromkeys(PROCESS_BUCKETS, 0.0)
        self.totals = dict.fromkeys(PROCESS_BUCKETS, 0.0)
        self._steps = 0
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._started_at: float | None = None  # when startup_done was called
        self._first_noted = False  # the incarnation's first step (a span's first step is reset every span)
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self._pending_fd: int | None = None
        self._pending_t = float("-inf")  # when the pending span was last written
        self.path: Path | None = None
        if rank == 0 if write is None else write:
            self._open(ledger_dir(run_dir), start)
            atexit.register(self.flush)

    # ---- boundaries: each closes the current period -------------------------------------------------------

    def startup_done(self) -> None:
        """Training is about to start: the time so far (interpreter, imports, model build, restore) was startup.

        Written at once, so an incarnation that dies at its first step still shows its startup and restore.
        """
        self._started_at = self._clock()
        self._close("startup", self._started_at)
        self._residual = "other"
        self._write_span()

    def step_begin(self) -> None:
        """Optional: the gap since the last step (logging, validation, callbacks) goes to ``other``.

        Without it, a step's period runs from the previous boundary, so everything between steps that is not
        reported as a measured piece counts as productive.
        """
        self._close(self._residual, self._clock())
        self._residual = "other"

    def step_end(self, step: int) -> None:
        """A training step finished; ``step`` is the number of steps done (the number checkpoints are named by).

        Before startup ended (no ``startup_done``/``step_begin`` yet) the first step counts as startup, which
        also absorbs compilation and warm-up.
        """
        now = self._clock()
        self._close("productive" if self._residual == "other" else "startup", now)
        self._residual = "other"
        if self._first_step is None:
            self._first_step = step
        if not self._first_noted:
            self._first_noted = True
            if self._started_at is not None:  # the first step of a (resumed) run: warm-up, compilation
                self.note("first_step", step=step, seconds=round(now - self._started_at, 4))
        self._last_step = step
        self._steps += 1
        if now - self._span_t0 >= self.span_s:
            self._write_span()
        elif self._pending_fd is not None and now - self._pending_t >= PENDING_EVERY_S:
            self._pending_t = now
            self._write_pending()

    # ---- measured pieces: carved out of the period they happened in --------------------------------------

    def data_wait(self, seconds: float) -> None:
        """Time the training loop blocked on the data loader (``next()``); overlapped loading is not badput."""
        self._wait += seconds

    def checkpoint_stall(self, seconds: float, step: int) -> None:
        """Time a save blocked training (staging, waiting for the previous save), not the background write."""
        self._carve("checkpoint", seconds, step=step)

    def restored(self, step: int | None, seconds: float, parts: dict[str, float] | None = None) -> None:
        """Discovery and load took ``seconds`` and resumed at ``step`` (None: nothing to resume, a fresh start).

        ``parts``: what the seconds were spent on (``discover_s``, ``verify_s``, ``read_s``; the rest of them
        is putting the state in place). Report it before the boundary that ends the period it happened in
        (before ``startup_done``).
        """
        self._carve("restore", seconds, step=step, **{name: round(value, 4) for name, value in (parts or {}).items()})

    def emergency(self, seconds: float, reason: str) -> None:
        """Time spent on fault handling (emergency save, draining, health checks after an error)."""
        self._carve("emergency", seconds, reason=reason)

    # ---- markers and output ---------------------------------------------------------------------------------

    def fault(self, reason: str, step: int | None = None) -> None:
        """A fault was seen (GPU error, preemption notice); a marker only, the time goes on as before."""
        self.note("fault", reason=reason, step=step)

    def note(self, kind: str, **fields: Any) -> None:
        """Write an informational event (no time accounting); safe from background threads."""
        self._write({"e": kind, "t": self._to_wall(self._clock()), **fields})

    def flush(self) -> None:
        """Write what has accumulated and sync it to disk (call at checkpoint time and before stopping)."""
        self._write_span()
        self._sync()

    def end(self, reason: str = COMPLETED) -> None:
        """Close the incarnation; any reason but ``"completed"`` counts as a failure (an interruption)."""
        now = self._clock()
        self._close(self._residual, now)
        self._write_span()
        self._write({"e": "end", "t": self._to_wall(now), "reason": reason})
        self._sync()
        atexit.unregister(self.flush)
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            self._close_pending(remove=True)  # the spans hold everything now

    def metrics(self) -> dict[str, float]:
        """Live figures of this incarnation for loggers (the whole run's are in :func:`summarize`)."""
        closed = {b: self.totals[b] + self._acc[b] for b in PROCESS_BUCKETS}
        elapsed = self._clock() - self._start
        return {
            "goodput/incarnation_pct": 100.0 * closed["productive"] / elapsed if elapsed > 0 else 0.0,
            **{f"goodput/{b}_s": v for b, v in closed.items()},
        }

    # ---- internals ------------------------------------------------------------------------------------------

    def _carve(self, bucket: str, seconds: float, **fields: Any) -> None:
        self._carved[bucket] = self._carved.get(bucket, 0.0) + seconds
        self.note(bucket, seconds=seconds, **fields)

    def _close(self, bucket: str, now: float) -> None:
        period = now - self._mark
        self._mark = now
        acc = self._acc
        wait, pieces = self._wait, self._carved
        if wait or pieces:
            carved = wait + sum(pieces.values()) if pieces else wait
            # Pieces reported as longer than the period they fall in (overlapping measurements) are scaled
            # down to fit, so no second is counted twice.
            scale = 1.0 if carved <= period else period / carved
            acc["data_wait"] += wait * scale
            for name, seconds in pieces.items():
                acc[name] += seconds * scale
            pieces.clear()
            self._wait = 0.0
            period -= carved * scale
        acc[bucket] += period

    def _write_span(self) -> None:
        acc = self._acc
        if not any(acc.values()):
            return
        record: dict[str, Any] = {
            "e": "span",
            "t0": self._to_wall(self._span_t0),
            "t1": self._to_wall(self._mark),
            "s": {b: round(v, 6) for b, v in acc.items() if v},
        }
        if self._steps:
            record.update(first_step=self._first_step, last_step=self._last_step, steps=self._steps)
        for name, value in acc.items():
            self.totals[name] += value
            acc[name] = 0.0
        self._span_t0 = self._mark
        self._steps = 0
        self._first_step = None
        self._write(record)

    def _write_pending(self) -> None:
        """The span :meth:`_write_span` would write now, over the last one in the side file: what a kill before
        the next span leaves. Formatted by hand and written with one ``pwrite`` (a few microseconds a step)."""
        seconds = ",".join(f'"{b}":{v:.6f}' for b, v in self._acc.items() if v)
        line = (
            f'{{"e":"span","t0":{self._to_wall(self._span_t0)!r},"t1":{self._to_wall(self._mark)!r},'
            f'"s":{{{seconds}}},"first_step":{self._first_step},"last_step":{self._last_step},"steps":{self._steps}}}'
        )
        try:
            os.pwrite(self._pending_fd, line.ljust(_PENDING_BYTES).encode(), 0)  # type: ignore[arg-type]
        except OSError as exc:  # accounting must never stop training: the spans alone still count
            log.debug("goodput ledger %s: pending span not written: %s", self.path, exc)
            self._close_pending(remove=False)

    def _close_pending(self, *, remove: bool) -> None:
        fd, self._pending_fd = self._pending_fd, None
        if fd is None or self.path is None:
            return
        os.close(fd)
        if remove:
            with contextlib.suppress(OSError):
                os.unlink(pending_path(self.path))

    def _to_wall(self, perf: float) -> float:
        return round(self._wall_ref + (perf - self._perf_ref), 6)

    def _open(self, directory: Path, start: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        numbers = (p.stem.removeprefix("incarnation-") for p in directory.glob("incarnation-*.jsonl"))
        index = max((int(n) for n in numbers if n.isdigit()), default=-1) + 1
        while True:
            path = directory / f"incarnation-{index:06d}.jsonl"
            try:
                self._file = open(path, "x", encoding="utf-8")  # noqa: SIM115 (lives as long as the ledger)
                break
            except FileExistsError:
                index += 1
        self.path = path
        try:
            self._pending_fd = os.open(pending_path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # the spans alone still count; a kill then loses the time since the last one
            log.debug("goodput ledger %s: no pending-span file: %s", path, exc)
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        generation = os.environ.get("RESILIENCE_GENERATION")  # resilience.recovery.inplace.ENV_GENERATION
        self._write(
            {
                "e": "start",
                "v": FORMAT_VERSION,
                "t": round(start, 6),
                "ledger_t": self._to_wall(self._perf_ref),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "rank": self.rank,
                "restart_count": int(restarts) if restarts and restarts.isdigit() else None,
                "generation": int(generation) if generation and generation.isdigit() else None,
            }
        )
        self._sync()

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line)
                self._file.flush()
            except OSError as exc:  # accounting must never stop training
                log.warning("goodput ledger %s: write failed (%s); further events are dropped", self.path, exc)
                self._file = None

    def _sync(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    os.fsync(self._file.fileno())
                except OSError as exc:
                    log.debug("goodput ledger %s: fsync failed: %s", self.path, exc)
