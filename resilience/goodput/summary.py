"""The whole life of a run from its ledger files: buckets, goodput, and what each restart cost.

Two things only become known across incarnations, so they are worked out here rather than while training:

* **Lost progress.** When an incarnation resumes at step ``s``, every earlier incarnation's work on steps
  after ``s`` is thrown away and will be redone. That productive time moves to ``lost`` (it is not counted
  twice). A span's steps are taken as equally long, so a span straddling ``s`` gives up its share.
* **Downtime.** The time between one incarnation's last record and the next one's process start: the job was
  down, queued, or hung. A killed incarnation's last record is its pending span (``*.pending.json``, written at
  each step's end between spans, at most every 10 ms): what it did after its last step ended lands here.

The buckets add up to the wall time by construction: within an incarnation the ledger fills them from
contiguous spans, lost time is moved rather than added, and downtime is the gaps between incarnations
(clamped at zero when clocks of different hosts disagree, which then stretches the wall time to match).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resilience.errors import ResilienceError
from resilience.goodput.ledger import COMPLETED, LEDGER_DIR, LOAD_PARTS, ledger_dir, pending_path

log = logging.getLogger(__name__)

# An incarnation's way back to training after a restart, in order (with the downtime before it).
IN_PLACE, REPLACED, RELAUNCH = "in place", "replaced", "relaunch"  # restart kinds: see restart_kind
RECOVERY_PARTS = ("startup_s", *LOAD_PARTS, "in_place_s", "first_step_s")
BUCKETS = ("productive", "data_wait", "checkpoint", "restore", "startup", "lost", "emergency", "other", "downtime")
LABELS = {
    "productive": "productive steps",
    "data_wait": "data wait",
    "checkpoint": "checkpoint stall",
    "restore": "restore",
    "startup": "startup",
    "lost": "lost progress",
    "emergency": "emergency handling",
    "other": "other (eval, logging)",
    "downtime": "downtime",
}
# Retries of transfers to the durable tier, by who retried: the ledger event and its running count's field.
RETRIES = {"storage": ("save_storage_retry", "storage_retries"), "upload": ("save_upload_retry", "upload_retries")}


@dataclass
class Span:
    """One ``span`` line: contiguous accounted time and the steps finished in it."""

    t0: float
    t1: float
    seconds: dict[str, float]
    first_step: int | None = None
    last_step: int | None = None
    steps: int = 0
    lost_s: float = 0.0

    def lost_share(self, kept_upto: float) -> float:
        """Fraction of this span's steps above ``kept_upto`` (steps equally long, numbered consecutively)."""
        if self.first_step is None or self.last_step is None or self.last_step <= kept_upto:
            return 0.0
        if self.first_step > kept_upto:
            return 1.0
        return min(1.0, (self.last_step - kept_upto) / (self.last_step - self.first_step + 1))


@dataclass
class Incarnation:
    """One process lifetime of the run, as its ledger file tells it."""

    index: int
    path: str
    start: float
    end: float
    pid: int | None
    host: str | None
    restart_count: int | None
    generation: int | None  # under ``resilience launch``: the generation it trained in
    end_reason: str | None
    restored_step: int | None
    restore_inferred: bool
    first_step: int | None
    last_step: int | None
    buckets: dict[str, float]
    downtime_before_s: float = 0.0
    redone_steps: int = 0
    lost_s: float = 0.0
    failed: bool = False
    spans: list[Span] = field(default_factory=list, repr=False)
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)
    recovery: dict[str, float] = field(default_factory=dict)  # RECOVERY_PARTS: how it got back to training
    restart: str | None = None  # how it began after the previous one (RESTART_KINDS), None for the first
    read_from: dict[str, float] = field(default_factory=dict)  # its restore's bytes by place: disk, peers, a tier
    retries: dict[str, int] = field(default_factory=dict)  # RETRIES: the storage client's own, the pack's

    @property
    def uptime_s(self) -> float:
        return self.end - self.start

    @property
    def recovery_s(self) -> float:
        """From the previous incarnation's last record to this one's first step done (0 for the first)."""
        return self.downtime_before_s + sum(self.recovery.values()) if self.index else 0.0

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("spans")
        row.pop("events")
        row["stragglers"] = [e for e in self.events if e["e"].startswith("straggler")]
        row["uptime_s"] = self.uptime_s
        row["recovery_s"] = self.recovery_s
        return row


@dataclass
class GoodputSummary:
    """Buckets in seconds over the run's whole life; ``buckets`` sums to ``wall_s``."""

    run_dir: str
    start: float
    end: float
    wall_s: float
    buckets: dict[str, float]
    incarnations: list[Incarnation]
    failures: int
    skipped_lines: int

    @property
    def goodput_pct(self) -> float:
        return 100.0 * self.buckets["productive"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def uptime_s(self) -> float:
        return sum(inc.uptime_s for inc in self.incarnations)

    @property
    def observed_mtbf_s(self) -> float | None:
        """Uptime per failure; None before the first failure."""
        return self.uptime_s / self.failures if self.failures else None

    @property
    def retries(self) -> dict[str, int]:
        """Retries of transfers to the durable tier over the whole run, by who retried (``RETRIES``)."""
        return {who: sum(inc.retries.get(who, 0) for inc in self.incarnations) for who in RETRIES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir,
            "start": self.start,
            "end": self.end,
            "wall_s": self.wall_s,
            "goodput_pct": self.goodput_pct,
            "buckets": dict(self.buckets),
            "buckets_pct": {b: 100.0 * s / self.wall_s if self.wall_s > 0 else 0.0 for b, s in self.buckets.items()},
            "failures": self.failures,
            "uptime_s": self.uptime_s,
            "observed_mtbf_s": self.observed_mtbf_s,
            "retries": self.retries,
            "skipped_lines": self.skipped_lines,
            "incarnations": [inc.to_dict() for inc in self.incarnations],
        }


def read_events(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """Records of one ledger file and how many lines were unreadable (a kill mid-write tears the last one)."""
    records: list[dict[str, Any]] = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(record, dict) and "e" in record:
                records.append(record)
            else:
                skipped += 1
    return records, skipped


def summarize(run_dir: str | os.PathLike[str]) -> GoodputSummary:
    """Read every incarnation of the run under ``run_dir`` (or its ``goodput/`` folder itself)."""
    directory = Path(run_dir)
    if directory.name != LEDGER_DIR and ledger_dir(directory).is_dir():
        directory = ledger_dir(directory)
    files = sorted(directory.glob("incarnation-*.jsonl"))
    if not files:
        raise ResilienceError(
            f"No goodput ledger under {run_dir}: expected {LEDGER_DIR}/incarnation-*.jsonl, written by "
            "GoodputLedger(run_dir) on rank 0 (the Lightning and Accelerate adapters do this when goodput is on)"
        )
    incarnations: list[Incarnation] = []
    skipped = 0
    for path in files:
        records, bad = read_events(path)
        skipped += bad
        incarnation = _incarnation(len(incarnations), path, records)
        if incarnation is None:
            log.warning("goodput ledger %s has no start record; ignored", path)
            continue
        incarnations.append(incarnation)
    if not incarnations:
        raise ResilienceError(f"No readable goodput ledger file under {directory}")
    _account_restarts(incarnations)
    buckets = dict.fromkeys(BUCKETS, 0.0)
    for inc in incarnations:
        for name, seconds in inc.buckets.items():
            buckets[name] += seconds
    return GoodputSummary(
        run_dir=str(run_dir),
        start=incarnations[0].start,
        end=incarnations[-1].end,
        wall_s=sum(buckets.values()),
        buckets=buckets,
        incarnations=incarnations,
        failures=sum(inc.failed for inc in incarnations),
        skipped_lines=skipped,
    )


def _incarnation(index: int, path: Path, records: list[dict[str, Any]]) -> Incarnation | None:
    start = next((r for r in records if r["e"] == "start"), None)
    if start is None:
        return None
    spans = [_span(r) for r in records if r["e"] == "span"]
    end = next((r for r in reversed(records) if r["e"] == "end"), None)
    if end is None:  # killed, or still running: the steps and time since its last span are in the side file
        pending = _pending_span(path, spans[-1].t1 if spans else float(start["t"]))
        spans += [pending] if pending is not None else []
    buckets = dict.fromkeys(BUCKETS, 0.0)
    for span in spans:
        for name, seconds in span.seconds.items():
            buckets[name if name in buckets else "other"] += seconds
    stepped = [s for s in spans if s.last_step is not None]
    restores = [r for r in records if r["e"] == "restore"]
    first = next((r for r in records if r["e"] == "first_step"), {})
    restore = restores[-1] if restores else {}
    loading = {part: float(restore.get(part, 0.0)) for part in LOAD_PARTS}
    recovery = {
        "startup_s": buckets["startup"],  # interpreter, imports, model, process group: all before the restore
        **loading,
        "in_place_s": max(0.0, float(restore.get("seconds", 0.0)) - sum(loading.values())),
        "first_step_s": float(first.get("seconds", 0.0)),
    }
    first_step = stepped[0].first_step if stepped else None
    # A checkpoint's step was reached, even where no span of that step survives (a ledger without side files).
    saved = [r["step"] for r in records if r["e"] == "checkpoint" and isinstance(r.get("step"), int)]
    last_step = max([*(s.last_step for s in stepped if s.last_step is not None), *saved], default=None)
    restored_step: int | None
    if restores:  # a restore that found nothing (step None) is a fresh start: every earlier step is redone
        restored_step = restore.get("step")
        restored_step = 0 if restored_step is None else restored_step
    else:  # no restore reported: the first step done says where it resumed
        restored_step = first_step - 1 if first_step is not None else None
    return Incarnation(
        index=index,
        path=str(path),
        start=start["t"],
        end=spans[-1].t1 if spans else start["t"],
        pid=start.get("pid"),
        host=start.get("host"),
        restart_count=start.get("restart_count"),
        generation=start.get("generation"),
        end_reason=end.get("reason") if end else None,
        restored_step=restored_step,
        restore_inferred=not restores,
        first_step=first_step,
        last_step=last_step,
        buckets=buckets,
        spans=spans,
        events=[r for r in records if r["e"] not in ("start", "span")],
        recovery=recovery,
        read_from={k[5:-6]: float(v) for k, v in restore.items() if k.startswith("from_") and k.endswith("_bytes")},
        retries=_retries(records),
    )


def _retries(records: list[dict[str, Any]]) -> dict[str, int]:
    """Each kind of retry's count in one incarnation: the highest running count its events carry (a torn last
    line loses nothing the next event would not repeat)."""
    return {
        who: int(max((float(r.get(name, 0)) for r in records if r["e"] == event), default=0))
        for who, (event, name) in RETRIES.items()
    }


def _span(record: dict[str, Any]) -> Span:
    return Span(
        record["t0"],
        record["t1"],
        record.get("s", {}),
        record.get("first_step"),
        record.get("last_step"),
        record.get("steps", 0),
    )


def _pending_span(ledger_file: Path, after: float) -> Span | None:
    """The span a killed incarnation had not written yet (its side file), when it follows the last one written
    (``after``): the steps it reached and the time it trained since. A stale, torn or odd file counts as none."""
    try:
        record = json.loads(pending_path(ledger_file).read_bytes())
        span = _span(record)
        valid = (
            record.get("e") == "span"
            and all(isinstance(v, (int, float)) for v in (span.t0, span.t1, *span.seconds.values()))
            and all(isinstance(v, int) for v in (span.first_step, span.last_step, span.steps))
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if not valid or abs(span.t0 - after) > 1e-3 or span.t1 <= span.t0:
        return None
    return span


def restart_kind(before: Incarnation, inc: Incarnation) -> str:
    """How ``inc`` followed ``before`` (rank 0's records): in the same process (a restart in place, or another
    ``fit()``), in a process that ``resilience launch`` gave the next generation (rank 0 was lost and replaced),
    or in a new launch."""
    if (inc.pid, inc.host) == (before.pid, before.host):
        return IN_PLACE
    if inc.generation is not None and before.generation is not None and inc.generation > before.generation:
        return REPLACED
    return RELAUNCH


def _account_restarts(incarnations: list[Incarnation]) -> None:
    """Downtime, redone steps, lost productive time and failures: facts that need the neighbours."""
    reached: int | None = None
    for before, inc in zip([None, *incarnations[:-1]], incarnations, strict=True):
        if before is not None:
            inc.restart = restart_kind(before, inc)
            inc.downtime_before_s = max(0.0, inc.start - before.end)
            inc.buckets["downtime"] = inc.downtime_before_s
            if reached is not None and inc.restored_step is not None:
                inc.redone_steps = max(0, reached - inc.restored_step)
        if inc.last_step is not None:
            reached = inc.last_step if reached is None else max(reached, inc.last_step)
    kept_upto = float("inf")  # the lowest step any later incarnation resumed from
    for inc in reversed(incarnations):
        for span in inc.spans:
            span.lost_s = span.seconds.get("productive", 0.0) * span.lost_share(kept_upto)
            inc.lost_s += span.lost_s
        inc.buckets["productive"] -= inc.lost_s
        inc.buckets["lost"] += inc.lost_s
        if inc.restored_step is not None:
            kept_upto = min(kept_upto, inc.restored_step)
    last = incarnations[-1]
    for inc in incarnations:
        # The newest incarnation without an end record may still be running: not a failure yet.
        inc.failed = inc.end_reason != COMPLETED and (inc.end_reason is not None or inc is not last)
