"""Goodput through the Accelerate handle: checkpoint figures in a tracker, the timed loader's data wait and
starvation warning, the ledger of a run killed with SIGKILL and relaunched, and the "auto" save interval.

In-process jobs run on one CPU process; the kill and relaunch run the worker as plain processes, and one
``accelerate launch`` of two ranks checks that "auto" gives every rank the same plan.
"""

from __future__ import annotations

import itertools
import logging
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accelerate_resilience import ResiliencePlugin, attach
from resilience.cli import main as cli
from resilience.goodput import summarize
from tests.helpers import kill_tree
from tests.test_accelerate_handle import (  # noqa: F401 (fresh_accelerate: autouse fixture)
    ListTracker,
    assert_same_training,
    committed_steps,
    fresh_accelerate,
    new_job,
)
from tests.test_accelerate_launch import LAUNCH_TIMEOUT_S, WORKER, job_env, run_job
from tests.workers.accelerate_train import final_state, train

ITEM_S = 0.01  # per sample, in __getitem__
BATCH = 2
COMPUTE_S = 0.06  # per step
SAVE_S = 0.1  # a save's state_dict() of SlowState

pytestmark = pytest.mark.timeout(600)


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sleeps per sample, and keeps how long the sleeps really took (a busy machine wakes sleepers late)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.slept = 0.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        time.sleep(ITEM_S)
        self.slept += time.perf_counter() - t0
        return torch.full((4,), float(index)), torch.zeros(1)


class SlowState:
    """Registered for checkpointing: every save blocks training for ``save_s`` while it reads this state."""

    def __init__(self, save_s: float = SAVE_S) -> None:
        self.save_s = save_s

    def state_dict(self) -> dict[str, Any]:
        time.sleep(self.save_s)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_real_save_reaches_the_tracker_and_the_ledger(tmp_path: Path) -> None:
    tracker = ListTracker()
    job = new_job(tracker=tracker)
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path))) as resilience:
        assert resilience.run_dir == str(tmp_path)  # no project_dir: next to the checkpoints
        train(job, resilience, resilience.resume(), stop_at=3)  # accelerator.save_state() at step 3
        resilience.wait()  # the commit's figures are logged once it is in
    commits = [entry for entry in tracker.logged if "checkpoint/write_s" in entry]
    assert len(commits) == 1
    commit = commits[0]
    assert commit["checkpoint/committed_step"] == 3 and commit["step"] == 3  # logged at the current training step
    assert commit["checkpoint/bytes"] > 0 and commit["checkpoint/write_MBps"] > 0
    assert 0 <= commit["checkpoint/block_s"] < 5 and "checkpoint/gpu_util_save_pct" not in commit  # CPU run

    summary = summarize(tmp_path)
    (run,) = summary.incarnations
    assert run.end_reason == "completed" and summary.failures == 0
    assert run.restored_step == 0 and run.last_step == 3  # nothing to resume: a fresh start
    assert summary.buckets["checkpoint"] > 0 and summary.buckets["productive"] > 0
    assert sum(summary.buckets.values()) == pytest.approx(summary.wall_s)
    notes = [event for event in run.events if event["e"] == "save_local_commit"]
    assert [note["step"] for note in notes] == [3]


def test_timed_loader_measures_the_wait_leaves_saves_out_and_names_the_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = ListTracker()
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("test")
    dataset = SlowDataset(40)
    model = nn.Linear(4, 1)
    model, optimizer, loader = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), DataLoader(dataset, batch_size=BATCH)
    )
    save_s = 3 * SAVE_S  # long enough that the saves counted as waiting could not hide in the loader's own costs
    accelerator.register_for_checkpointing(SlowState(save_s))
    plugin = ResiliencePlugin(local_root=str(tmp_path), every_n_steps=5, async_staging=False, data_window_steps=5)
    with attach(accelerator, plugin) as resilience:
        batches = resilience.timed(loader)
        assert len(batches) == len(loader) == 20
        assert batches.dataset is dataset and batches.total_batch_size == BATCH  # loader attributes pass through
        with caplog.at_level(logging.WARNING, logger="resilience.goodput.data"):
            started = time.perf_counter()
            for x, y in batches:
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                time.sleep(COMPUTE_S)
            loop_s = time.perf_counter() - started
        assert resilience.global_step == 20
    # each blocked save_s inside the loader's next(); step 20's at the boundary close() ends; keep_last=3
    assert committed_steps(tmp_path) == [10, 15, 20]

    windows = [entry for entry in tracker.logged if "data/wait_fraction" in entry]
    assert len(windows) == 4
    # Nominally every window starves (20 ms of about 100 per step); one whose save queued behind the last one's
    # on a loaded machine may not, so each flag is checked against its own fraction, and one starving is needed.
    assert all(entry["data/starving"] == float(entry["data/wait_fraction"] > 0.05) for entry in windows)
    assert any(entry["data/starving"] == 1.0 for entry in windows)
    waited = sum(w["data/wait_ms_per_step"] * 5 for w in windows) / 1e3
    stepped = sum(w["data/step_ms"] * 5 for w in windows) / 1e3
    # Every step once, the saves inside next() included: from the first fetch to the last one, which only
    # ends the loop (the fourth save runs after it).
    assert loop_s - save_s < stepped <= loop_s
    # The dataset's sleeps (as long as they really took) all happen inside next(); the rest of a fetch
    # (collation, Accelerate's shard) adds a little. The three saves inside next() are left out: counted,
    # they would add 3 * save_s. Absolute times, so a loaded machine's late wake-ups shift neither bound.
    assert dataset.slept <= waited < dataset.slept + save_s
    first = windows[0]
    assert first["data/samples_per_s"] == pytest.approx(BATCH / (first["data/step_ms"] / 1e3))
    assert first["data/collate_ms_per_step"] < 5  # timed on the DataLoader inside Accelerate's: not the cause
    assert "goodput/incarnation_pct" in first
    warnings = [record.getMessage() for record in caplog.records if record.name == "resilience.goodput.data"]
    assert len(warnings) == 1, warnings  # at most every warn_every_s
    assert "rank 0" in warnings[0] and "(workers)" in warnings[0] and "num_workers=0" in warnings[0]

    summary = summarize(tmp_path)
    assert summary.buckets["data_wait"] == pytest.approx(waited, rel=0.05)
    assert summary.buckets["checkpoint"] >= 3 * save_s


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "plain"])
def test_timed_loader_keeps_resume_exact(tmp_path: Path, stateful: bool) -> None:
    job = new_job(stateful=stateful)
    with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path / "reference"))) as resilience:
        train(job, resilience, resilience.resume())
        want = final_state(job)
    for stop_at in (13, 0):  # stopped mid-epoch, then resumed through the wrapper (skip_first_batches on it)
        job = new_job(stateful=stateful)
        with attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path / "run"))) as resilience:
            point = resilience.resume()
            train(job, resilience, point, stop_at=stop_at, timed=True)
    assert (point.epoch, point.batch_in_epoch, point.global_step) == (1, 3, 13)
    assert_same_training(final_state(job), want)


def run_job_here(out: Path, env: dict[str, str]) -> dict[str, Any]:
    """The worker as one plain process, to the end; its rank-0 final state."""
    out.mkdir(parents=True)
    with (out / "worker.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(out)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:
        proc.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, (out / "worker.log").read_text()[-6000:]
    result: dict[str, Any] = torch.load(out / "final-rank0.pt", weights_only=False)
    return result


def test_sigkill_and_relaunch_show_in_the_ledger_with_lost_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    settings = {
        "ACCELERATE_RESILIENCE_LOCAL_ROOT": str(ckpt),
        "ACCELERATE_RESILIENCE_EVERY_N_STEPS": "4",
        "ACCELERATE_RESILIENCE_GOODPUT_SPAN_S": "0",  # a ledger line per step: the kill point shows exactly
        "TRAIN_STATEFUL": "0",
    }
    out = tmp_path / "killed"
    out.mkdir()
    with (out / "worker.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(out)],
            env=job_env(tmp_path, **settings, TRAIN_STEP_SLEEP="0.3"),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while True:  # steps past the last save, which is committed: kill now (the next save is 0.3 s a step away)
            assert proc.poll() is None, f"the job ended early:\n{(out / 'worker.log').read_text()}"
            assert time.monotonic() < deadline, "no step past a committed checkpoint in time"
            # The ledger first, the commits after: read the other way round under load, a save made and committed
            # between the two reads could be the step the job is killed at, and nothing would be lost.
            started = any((ckpt / "goodput").glob("incarnation-*.jsonl"))  # the folder comes before its file
            incarnations = summarize(ckpt).incarnations if started else []
            reached = incarnations[0].last_step if incarnations else None
            steps = committed_steps(ckpt)
            if reached is not None and steps and steps[-1] == reached // 4 * 4 < reached:
                break
            time.sleep(0.05)
    finally:
        kill_tree(proc)
        proc.wait(timeout=30)
    assert proc.returncode == -9

    got = run_job_here(tmp_path / "relaunched", job_env(tmp_path, **settings))
    resumed_at = got["resume"]["global_step"]
    assert got["resume"]["restored"] and resumed_at >= 4

    summary = summarize(ckpt)
    killed, relaunched = summary.incarnations
    assert summary.failures == 1 and killed.failed and killed.end_reason is None
    assert relaunched.end_reason == "completed" and relaunched.last_step == 30
    assert relaunched.restored_step == resumed_at and not relaunched.restore_inferred
    assert killed.last_step is not None and killed.last_step > resumed_at
    assert relaunched.redone_steps == killed.last_step - resumed_at
    assert killed.lost_s > 0 and summary.buckets["lost"] == pytest.approx(killed.lost_s)
    assert relaunched.buckets["restore"] > 0 and relaunched.downtime_before_s > 0
    assert sum(summary.buckets.values()) == pytest.approx(summary.wall_s)
    # the way back, split: start-up before the restore, its listing, checksums and read, the first step after it
    parts = relaunched.recovery
    assert all(parts[part] > 0 for part in ("startup_s", "discover_s", "verify_s", "read_s", "first_step_s")), parts
    restore = relaunched.buckets["restore"]
    assert parts["discover_s"] + parts["verify_s"] + parts["read_s"] + parts["in_place_s"] == pytest.approx(
        restore, abs=1e-3
    )
    assert relaunched.recovery_s == pytest.approx(relaunched.downtime_before_s + sum(parts.values()))
    assert killed.recovery_s == 0

    assert cli(["report", str(ckpt)]) == 0
    table = capsys.readouterr().out
    assert "2 incarnation(s), 1 failure(s)" in table and "killed (no end record)" in table
    assert f"{resumed_at:>10}  {relaunched.redone_steps:>6}" in table
    assert "Recovery per restart" in table and "FIRST STEP" in table


def test_auto_interval_is_young_daly_from_the_measured_costs(tmp_path: Path) -> None:
    # with a save of about SAVE_S: an interval of about sqrt(2 * 0.1 * 0.1) = 0.14 s, a few steps; a save blocking
    # 1 s on a loaded machine still leaves room for 3 saves in the 30 steps
    mtbf_s = 0.1
    tracker = ListTracker()
    job = new_job(tracker=tracker)
    job.accelerator.register_for_checkpointing(SlowState())
    plugin = ResiliencePlugin(
        local_root=str(tmp_path), every_n_steps="auto", mtbf_hours=mtbf_s / 3600, min_interval_s=0.01
    )
    with attach(job.accelerator, plugin) as resilience:
        train(job, resilience, resilience.resume(), sleep_s=0.05)
        plan = resilience.interval_plan
    assert plan is not None and plan.mtbf_source == "given" and plan.mtbf_s == pytest.approx(mtbf_s)
    assert plan.cost_s is not None and plan.cost_s >= SAVE_S and plan.step_s is not None and plan.step_s >= 0.05
    assert not plan.clamped and plan.interval_s == pytest.approx(math.sqrt(2 * plan.cost_s * mtbf_s))
    assert plan.interval_steps == max(1, round(plan.interval_s / plan.step_s))
    assert plan.expected_overhead == pytest.approx(plan.cost_s / plan.interval_s)
    assert plan.expected_lost_s_per_failure == pytest.approx(plan.interval_s / 2)

    saved = [entry["checkpoint/committed_step"] for entry in tracker.logged if "checkpoint/write_s" in entry]
    planned = [entry for entry in tracker.logged if "checkpoint/interval_steps" in entry]
    assert saved[0] == 5 and len(saved) >= 3  # the first save measures the cost
    assert [entry["step"] for entry in planned] == saved  # a plan after every save, where all ranks are
    for entry, following in zip(planned, saved[1:], strict=False):
        assert following == entry["step"] + entry["checkpoint/interval_steps"]
    # each logged plan is a Young/Daly plan of its own measured cost (the last commit may replan after the last
    # step boundary, so the final plan need not be among the logged ones)
    for entry in planned:
        interval_s, cost_s = (
            entry["checkpoint/interval_s"],
            entry["checkpoint/expected_overhead"] * entry["checkpoint/interval_s"],
        )
        assert entry["checkpoint/mtbf_s"] == plan.mtbf_s and cost_s >= SAVE_S
        assert interval_s == pytest.approx(math.sqrt(2 * cost_s * mtbf_s))
        assert entry["checkpoint/expected_lost_s_per_failure"] == pytest.approx(interval_s / 2)


def test_auto_interval_takes_the_mtbf_observed_from_the_runs_restarts(tmp_path: Path) -> None:
    def plugin() -> ResiliencePlugin:
        return ResiliencePlugin(local_root=str(tmp_path), every_n_steps="auto", min_interval_s=0.01)

    job = new_job()
    with pytest.raises(RuntimeError, match="lost a node"), attach(job.accelerator, plugin()) as resilience:
        train(job, resilience, resilience.resume(), stop_at=7)
        assert resilience.interval_plan is not None and resilience.interval_plan.mtbf_source == "prior"
        raise RuntimeError("lost a node")
    before = summarize(tmp_path)
    assert before.failures == 1 and before.incarnations[0].end_reason == "RuntimeError: lost a node"

    job = new_job()
    with attach(job.accelerator, plugin()) as resilience:
        train(job, resilience, resilience.resume())
        plan = resilience.interval_plan
    assert plan is not None and plan.mtbf_source == "observed"
    # one failure in all the uptime so far: the first incarnation's and this one's until the plan
    assert before.uptime_s <= plan.mtbf_s <= summarize(tmp_path).uptime_s


@pytest.mark.slow  # the same plan on every rank is also checked by the session parity test
def test_auto_interval_is_the_same_on_every_rank(tmp_path: Path) -> None:
    settings = {
        "ACCELERATE_RESILIENCE_LOCAL_ROOT": str(tmp_path / "ckpt"),
        "ACCELERATE_RESILIENCE_EVERY_N_STEPS": "auto",
        "ACCELERATE_RESILIENCE_MIN_INTERVAL_S": "0.01",
        "ACCELERATE_RESILIENCE_MAX_INTERVAL_S": "0.3",  # a few steps of at least 0.1 s
        "ACCELERATE_RESILIENCE_DATA_WINDOW_STEPS": "3",
        "TRAIN_STEP_SLEEP": "0.1",
        "TRAIN_TIMED": "1",
    }
    got = run_job(tmp_path / "out", job_env(tmp_path, **settings))
    plans = got[0]["plans"]
    assert len(plans) >= 2 and plans == got[1]["plans"]  # rank 0's plans, step by step, on both ranks
    assert all(plan["clamped"] and plan["mtbf_source"] == "prior" for _, plan in plans)
    for (step, plan), (following, _) in itertools.pairwise(plans):
        assert following == step + plan["interval_steps"]

    metrics = [line for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert sum('"checkpoint/interval_steps"' in line for line in metrics) >= len(plans)
    assert any('"data/wait_fraction"' in line for line in metrics)
    summary = summarize(tmp_path / "ckpt")
    assert len(summary.incarnations) == 1 and summary.incarnations[0].end_reason == "completed"  # rank 0 only
