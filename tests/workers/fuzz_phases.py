"""Crash-fuzz instrumentation of the phases of a save (see tests/test_reliability_fuzz.py), imported by a fuzzed
rank's training process and, through ``RESILIENCE_HELPER_PRELOAD``, by its checkpoint helper process, where
the shard writes, manifests, uploads and retention run.

``FUZZ_PLAN`` says whether this rank dies: when it enters ``phase`` for the ``occurrence``-th time, the whole
rank is SIGKILLed after ``delay_s`` (from a timer thread, so the phase goes on meanwhile): in the helper that
is the training process (``RESILIENCE_HELPER_PARENT_PID``) and the helper itself. With ``delivery`` "stop" the
rank's whole process group gets SIGTERM instead, as a scheduler stops a job: the training process (no health
guard here) dies of it, and its helpers, which ignore it, end with it. Phase entries and exits go
to ``FUZZ_TRACE_DIR/rank-<R>.log`` with unbuffered appends, so the record survives the kill.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilience.checkpoint.staging import HostStager
from resilience.persist import pipeline as pipeline_module
from resilience.persist.pipeline import RecordingWriter
from resilience.storage import proofs as proofs_module
from resilience.storage.tiers import DurableTier, LocalTier

# Where a kill can be planned: the phases a save goes through, by the function that does each.
PHASES: dict[str, list[tuple[Any, str]]] = {
    "staging": [(HostStager, "stage")],
    "shards": [(RecordingWriter, "write_data")],
    "dcp-metadata": [(RecordingWriter, "finish")],
    "hash": [(proofs_module, "hash_stream")],
    "manifest": [(LocalTier, "write_exclusive"), (DurableTier, "write_exclusive")],
    "upload": [(DurableTier, "put_file")],
    "retention": [(pipeline_module, "remove_checkpoint")],
}


class Trace:
    """Append-only lines in a file; each one is a single write(2), complete or absent after a SIGKILL."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, *words: object) -> None:
        os.write(self._fd, (" ".join(map(str, words)) + "\n").encode())


def die_after(trace: Trace, delay_s: float, why: str, delivery: str) -> None:
    trace("kill", why, f"{delay_s:.4f}")
    die = _stop if delivery == "stop" else _die
    if delay_s <= 0:
        die()
    threading.Timer(delay_s, die).start()


def _stop() -> None:
    """SIGTERM to the rank's process group (each rank is a session of its own): the training process and helpers."""
    os.killpg(os.getpgid(0), signal.SIGTERM)


def _die() -> None:
    """The whole rank: from its helper, the training process first, then the helper."""
    parent = os.environ.get("RESILIENCE_HELPER_PARENT_PID")
    if parent:
        os.kill(int(parent), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def instrument(trace: Trace, plan: dict[str, Any], rank: int) -> None:
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    armed = plan["phase"] in PHASES and plan["rank"] == rank

    def wrap(phase: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            with lock:
                counts[phase] += 1
                n = counts[phase]
            trace("enter", phase, n)
            if armed and phase == plan["phase"] and n == plan["occurrence"]:
                die_after(trace, plan["delay_s"], f"{phase}#{n}", plan["delivery"])
            try:
                return original(*args, **kwargs)
            finally:
                trace("exit", phase, n)

        return traced

    for phase, places in PHASES.items():
        for owner, name in places:
            setattr(owner, name, wrap(phase, getattr(owner, name)))


if "FUZZ_PLAN" in os.environ and "FUZZ_TRACE_DIR" in os.environ:
    _rank = int(os.environ.get("RANK", "0"))
    instrument(Trace(Path(os.environ["FUZZ_TRACE_DIR"]), _rank), json.loads(os.environ["FUZZ_PLAN"]), _rank)
