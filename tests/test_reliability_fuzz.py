"""Crash fuzzing: SIGKILL a 2-rank gloo training run at random moments, then resume and check what comes back.

Each trial is drawn from one seed: which phase of a save to die in (staging, shard writes, manifest write,
upload, retention delete, or a kill from outside at a random time), how the rank dies (SIGKILL of the training
process and its helper, or SIGTERM to the rank's whole process group as a scheduler stops a job: the helpers
ignore it and end with the training process, which has no health guard here and dies of it), which rank, at
which occurrence of the phase and after what delay, how long the surviving rank runs on before the launcher
tears the job down, whether the durable tier is a ``file://`` directory or moto's S3 server, whether the
node's local disk is lost too, and whether the job resumes on 1 or 2 ranks. After the kill:

* every checkpoint that has a manifest verifies in full (a kill never leaves a partial commit);
* the newest of them is at least the newest commit the dead run reported (nothing committed is lost; the
  retention policy keeps the newest two);
* a fresh job resumes exactly that step, with exactly its values, and saves the next one.

The default run does a few trials; ``-m slow`` runs the full set (``RESILIENCE_FUZZ_TRIALS``, default 30).
``RESILIENCE_FUZZ_SEED=N`` runs only trial N; ``RESILIENCE_FUZZ_REPORT=FILE`` appends one JSON line per trial.
A seed fixes every choice above; the exact instant a kill lands still depends on thread timing.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from resilience.storage.catalog import scan, verify
from resilience.storage.tiers import DurableTier, LocalTier
from tests.helpers import WORKERS, check_ranks, kill_tree, run_ranks, start_ranks

WORKER = WORKERS / "reliability_fuzz.py"
KILL_PHASES = ("staging", "shards", "manifest", "upload", "retention", "timer")
MAX_DELAY_S = {"staging": 0.005, "shards": 0.05, "manifest": 0.005, "upload": 0.05, "retention": 0.005}
DEFAULT_SEEDS = (0, 11)  # SIGKILL in staging; SIGTERM from outside to one rank's process group, or both
FULL_TRIALS = int(os.environ.get("RESILIENCE_FUZZ_TRIALS", "30"))
TRIAL_TIMEOUT_S = 180.0


@dataclass
class Plan:
    seed: int
    phase: str
    delivery: str  # "kill": SIGKILL; "stop": SIGTERM to the rank's process group, then SIGKILL (the launcher)
    rank: int | None  # the rank that dies first; None: both at once (timer only)
    occurrence: int
    delay_s: float
    grace_s: float  # how long the other rank runs on before the launcher kills it
    durable: str
    lose_local: bool
    resume_world: int


def plan_for(seed: int) -> Plan:
    rng = random.Random(seed)
    phase = KILL_PHASES[seed % len(KILL_PHASES)]  # consecutive seeds cover every phase
    if phase == "timer":
        rank: int | None = rng.choice([0, 1, None])
        delay = rng.uniform(0.0, 6.0)  # from start-up through the first dozen saves (0.3-0.5 s each here)
    else:
        rank = 0 if phase in ("manifest", "retention") else rng.choice([0, 1])  # rank 0's jobs
        delay = 0.0 if rng.random() < 0.3 else rng.uniform(0.0, MAX_DELAY_S[phase])
    return Plan(
        seed=seed,
        phase=phase,
        delivery="stop" if (seed // len(KILL_PHASES)) % 2 else "kill",  # every phase both ways, 6 seeds each
        rank=rank,
        occurrence=rng.randint(1, 6),
        delay_s=round(delay, 4),
        grace_s=round(rng.uniform(0.0, 0.5), 3),
        durable=rng.choice(["file", "file", "s3"]),
        lose_local=rng.random() < 0.25,
        resume_world=rng.choice([1, 2]),
    )


def trial_seeds() -> list[Any]:
    if "RESILIENCE_FUZZ_SEED" in os.environ:
        return [int(os.environ["RESILIENCE_FUZZ_SEED"])]
    return [
        pytest.param(seed, marks=() if seed in DEFAULT_SEEDS else pytest.mark.slow)
        for seed in range(max(DEFAULT_SEEDS) + 1 + FULL_TRIALS)
    ]


@pytest.mark.parametrize("seed", trial_seeds())
def test_crash_fuzz(seed: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    plan = plan_for(seed)
    try:
        row = run_trial(plan, tmp_path, request)
    except AssertionError as exc:
        raise AssertionError(
            f"fuzz trial {plan} failed; rerun it with RESILIENCE_FUZZ_SEED={seed} "
            f"pytest tests/test_reliability_fuzz.py\n{exc}"
        ) from exc
    if report := os.environ.get("RESILIENCE_FUZZ_REPORT"):
        with open(report, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def run_trial(plan: Plan, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    local, traces, logs = tmp_path / "local", tmp_path / "trace", tmp_path / "logs"
    logs.mkdir()
    options: dict[str, Any] = {}
    if plan.durable == "s3":
        s3 = request.getfixturevalue("s3")
        durable_url, options = str(s3["url"]), dict(s3["options"])
    else:
        durable_url = f"file://{tmp_path / 'remote'}"
    env = {"TEST_STATE_SCALE": "256", "TEST_STORAGE_OPTIONS": json.dumps(options)}
    args = [str(local), durable_url, str(traces)]

    t0 = time.monotonic()
    procs = start_ranks(
        WORKER, ["train", *args], 2, env={**env, "FUZZ_PLAN": json.dumps(asdict(plan))}, output_dir=logs
    )
    try:
        supervise(procs, plan, traces, logs)
    finally:
        for proc in procs:
            kill_tree(proc)
            proc.wait()
    lines = {rank: read_trace(traces / f"rank-{rank}.log") for rank in (0, 1)}
    killed = [rank for rank in (0, 1) if any(line[0] == "kill" for line in lines[rank])] or [
        rank for rank in (0, 1) if plan.rank in (None, rank)
    ]
    commits = {
        kind: max((int(line[1]) for rank in (0, 1) for line in lines[rank] if line[0] == kind), default=None)
        for kind in ("local_commit", "durable_commit")
    }

    if plan.lose_local:  # the node is gone: only the durable tier is left
        shutil.rmtree(local, ignore_errors=True)
    tiers = [LocalTier(local), DurableTier(durable_url, options)]
    committed = [entry for tier in tiers for entry in scan(tier) if entry.committed]
    for entry in committed:
        verify(entry, full=True)  # raises CorruptCheckpointError: a kill produced a partial commit
    newest = max((entry.step for entry in committed), default=None)
    reported = [commits["durable_commit"]] if plan.lose_local else list(commits.values())
    floor = max((step for step in reported if step is not None), default=None)
    assert floor is None or (newest is not None and newest >= floor), (
        f"the run reported step {floor} committed, but the newest checkpoint left is {newest}"
    )

    want = "none" if newest is None else str(newest)
    resumed = check_ranks(
        run_ranks(WORKER, ["resume", *args], plan.resume_world, env={**env, "TEST_EXPECT_STEP": want}, timeout=180)
    )
    tier = resumed[0].output.split("RESUMED", 1)[1].split()[1]
    return {
        **asdict(plan),
        "killed": killed,
        "in_progress": sorted({phase for rank in killed for phase in open_phases(lines[rank])}),
        "reported": commits,
        "resumed": newest,
        "tier": tier,
        "seconds": round(time.monotonic() - t0, 1),
        "result": "ok",
    }


def supervise(procs: list[subprocess.Popen[str]], plan: Plan, traces: Path, logs: Path) -> None:
    """Deliver the timer kill, then act as the launcher: once a rank is dead, kill the rest after ``grace_s``."""
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    if plan.phase == "timer":
        while not all(has_line(traces / f"rank-{rank}.log", "ready") for rank in (0, 1)):
            assert all(p.poll() is None for p in procs), f"a rank died before it was ready\n{outputs(logs)}"
            assert time.monotonic() < deadline, f"ranks not ready within {TRIAL_TIMEOUT_S}s\n{outputs(logs)}"
            time.sleep(0.02)
        time.sleep(plan.delay_s)
        for rank, proc in enumerate(procs):
            if plan.rank in (None, rank):
                os.killpg(proc.pid, signal.SIGTERM if plan.delivery == "stop" else signal.SIGKILL)
    first_death: float | None = None
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, f"the run did not end within {TRIAL_TIMEOUT_S}s\n{outputs(logs)}"
        if first_death is None and (dead := [p.returncode for p in procs if p.poll() is not None]):
            first_death = time.monotonic()
            assert 0 not in dead, f"the planned kill never happened: the run finished\n{outputs(logs)}"
            killed_by = -signal.SIGTERM if plan.delivery == "stop" else -signal.SIGKILL
            assert killed_by in dead, f"ranks ended with {dead} before any kill: the engine failed\n{outputs(logs)}"
        if first_death is not None and time.monotonic() - first_death >= plan.grace_s:
            for proc in procs:
                kill_tree(proc)
        time.sleep(0.01)


def read_trace(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def has_line(path: Path, word: str) -> bool:
    return any(line[:1] == [word] for line in read_trace(path))


def open_phases(lines: list[list[str]]) -> set[str]:
    """Phases this rank had entered and not left when it died."""
    inside: set[tuple[str, str]] = set()
    for line in lines:
        if line[0] == "enter":
            inside.add((line[1], line[2]))
        elif line[0] == "exit":
            inside.discard((line[1], line[2]))
    return {phase for phase, _ in inside}


def outputs(logs: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text()[-4000:]}" for p in sorted(logs.glob("rank-*.out")))
