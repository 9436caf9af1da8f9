"""The goodput ledger: every second in one bucket, carried across restarts, lost progress, kills and torn lines."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilience.errors import ResilienceError
from resilience.goodput import GoodputLedger, summarize
from resilience.goodput.ledger import pending_path
from resilience.goodput.summary import read_events
from tests.helpers import WORKERS, base_env, kill_tree
from tests.workers.goodput_sim import FakeClock, incarnation
from tests.workers.goodput_worker import RESTORE_S, STEP_S, train


def test_buckets_sum_to_wall_time_on_a_real_clock(tmp_path: Path) -> None:
    started = time.time()
    ledger = GoodputLedger(tmp_path, process_start=started, span_s=0.05)
    time.sleep(0.05)  # building the model
    t0 = time.perf_counter()
    time.sleep(0.03)
    ledger.restored(7, time.perf_counter() - t0)
    ledger.startup_done()
    waits = 0.0
    for step in range(8, 28):
        t0 = time.perf_counter()
        time.sleep(0.004)
        wait = time.perf_counter() - t0
        waits += wait
        ledger.data_wait(wait)
        time.sleep(0.008)
        ledger.step_end(step)
        if step == 17:
            t0 = time.perf_counter()
            time.sleep(0.02)
            ledger.checkpoint_stall(time.perf_counter() - t0, step)
    ledger.end()
    wall = time.time() - started

    summary = summarize(tmp_path)
    assert summary.wall_s == pytest.approx(wall, rel=0.05)
    assert sum(summary.buckets.values()) == pytest.approx(summary.wall_s, abs=1e-6)
    assert summary.buckets["data_wait"] == pytest.approx(waits, rel=1e-3)
    assert summary.buckets["restore"] >= 0.03 and summary.buckets["checkpoint"] >= 0.02
    assert summary.buckets["startup"] >= 0.05
    assert summary.buckets["productive"] >= 20 * 0.008
    assert summary.failures == 0 and summary.incarnations[0].end_reason == "completed"


def test_each_call_fills_its_own_bucket_exactly(tmp_path: Path) -> None:
    clock = FakeClock(1_000.0)
    ledger = clock.ledger(tmp_path, span_s=100.0)
    clock.now = 7.0
    ledger.step_begin()  # startup ends at the first step even without startup_done()
    clock.now += 1.0
    ledger.step_end(1)
    clock.now += 0.5  # waiting for the batch
    ledger.data_wait(0.5)
    clock.now += 3.0  # validation, logging
    ledger.step_begin()
    clock.now += 1.0
    ledger.step_end(2)
    clock.now += 2.0
    ledger.checkpoint_stall(1.5, 2)
    ledger.emergency(0.5, "XID 79")
    ledger.step_begin()
    live = ledger.metrics()
    ledger.end()

    totals = summarize(tmp_path).buckets
    assert totals["startup"] == 7.0 and totals["productive"] == 2.0 and totals["data_wait"] == 0.5
    assert totals["other"] == 3.0 and totals["checkpoint"] == 1.5 and totals["emergency"] == 0.5
    assert sum(totals.values()) == 14.5
    assert live["goodput/incarnation_pct"] == pytest.approx(100 * 2.0 / 14.5)


def test_overlapping_measurements_are_scaled_never_counted_twice(tmp_path: Path) -> None:
    clock = FakeClock(0.0)
    ledger = clock.ledger(tmp_path)
    ledger.startup_done()
    clock.now += 1.0
    ledger.data_wait(3.0)  # wrongly measured: longer than the step it happened in
    ledger.checkpoint_stall(1.0, 1)
    ledger.step_end(1)
    ledger.end()
    totals = summarize(tmp_path).buckets
    assert totals["data_wait"] == pytest.approx(0.75) and totals["checkpoint"] == pytest.approx(0.25)
    assert totals["productive"] == 0.0 and sum(totals.values()) == pytest.approx(1.0)


def test_lost_progress_follows_every_later_resume(tmp_path: Path) -> None:
    # A: steps 1-100, killed. B: resumes at 80, steps 81-150, killed. C: resumes at 50 (newer ones were bad).
    t = incarnation(tmp_path, 0.0, restore=None, steps=100, end=None)
    t = incarnation(tmp_path, t + 60.0, restore=80, steps=70, end="fault: XID 79")
    incarnation(tmp_path, t + 30.0, restore=50, steps=10)

    summary = summarize(tmp_path)
    a, b, c = summary.incarnations
    assert (b.restored_step, b.redone_steps) == (80, 20)
    assert (c.restored_step, c.redone_steps) == (50, 100)
    # A's steps 51-100 and all of B's 81-150 were thrown away: 1 s of productive time each.
    assert a.lost_s == pytest.approx(50.0) and b.lost_s == pytest.approx(70.0) and c.lost_s == 0.0
    assert summary.buckets["lost"] == pytest.approx(120.0)
    assert summary.buckets["productive"] == pytest.approx(180.0 - 120.0)
    assert summary.buckets["downtime"] == pytest.approx(90.0)
    assert sum(summary.buckets.values()) == pytest.approx(summary.wall_s)
    assert summary.wall_s == pytest.approx(summary.end - summary.start)
    assert [i.failed for i in summary.incarnations] == [True, True, False]
    assert a.restore_inferred and a.restored_step == 0 and not b.restore_inferred


def test_a_span_straddling_the_resume_point_gives_up_its_share(tmp_path: Path) -> None:
    t = incarnation(tmp_path, 0.0, restore=None, steps=20, span_s=1e9, end=None)  # one span: steps 1-20
    incarnation(tmp_path, t, restore=15, steps=5)
    summary = summarize(tmp_path)
    assert summary.incarnations[0].lost_s == pytest.approx(5.0)


def test_a_fresh_restart_loses_everything_done_before(tmp_path: Path) -> None:
    t = incarnation(tmp_path, 0.0, restore=None, steps=10, end=None)
    incarnation(tmp_path, t, restore=0, steps=10)  # restore found nothing: restored(None, ...)
    summary = summarize(tmp_path)
    assert summary.incarnations[1].redone_steps == 10 and summary.buckets["lost"] == pytest.approx(10.0)


def test_a_kill_between_spans_keeps_the_pending_span_and_a_stale_one_is_ignored(tmp_path: Path) -> None:
    """Killed 30 steps into a 1000 s span: the pending span (side file) holds the steps and their time; an older
    pending span than the last written span adds nothing; without the side file a saved step is still reached."""
    clock = FakeClock(1_000.0)
    ledger = clock.ledger(tmp_path, span_s=1000.0)
    clock.now += 10.0
    ledger.startup_done()
    for step in range(1, 31):
        clock.now += 1.0
        ledger.step_end(step)
        if step == 20:
            clock.now += 2.0
            ledger.checkpoint_stall(2.0, step)
    assert ledger.path is not None
    pending = pending_path(ledger.path)
    (killed,) = summarize(tmp_path).incarnations  # no end record: a kill, as far as the files tell
    assert (killed.first_step, killed.last_step, killed.end - killed.start) == (1, 30, pytest.approx(42.0))
    assert killed.buckets["productive"] == pytest.approx(30.0) and killed.buckets["checkpoint"] == pytest.approx(2.0)

    ledger.flush()  # a span written after the pending one: the side file is stale now
    clock.now += 5.0  # ... and a kill before the next step ends
    (flushed,) = summarize(tmp_path).incarnations
    assert flushed.last_step == 30 and flushed.buckets["productive"] == pytest.approx(30.0)
    ledger.end()
    assert not pending.exists()  # only a killed incarnation leaves one

    older = FakeClock(1_000.0).ledger(tmp_path / "older", span_s=1000.0)
    older.startup_done()
    for step in (1, 2):
        older.step_end(step)
    older.checkpoint_stall(1.0, 2)
    assert older.path is not None
    pending_path(older.path).unlink()  # as a ledger without side files leaves it: the last span is startup's
    (without,) = summarize(tmp_path / "older").incarnations
    assert without.last_step == 2  # the step it saved


def test_only_rank_zero_writes(tmp_path: Path) -> None:
    ledger = GoodputLedger(tmp_path, rank=1)
    ledger.step_end(1)
    ledger.end()
    assert ledger.path is None and not (tmp_path / "goodput").exists()


def test_no_ledger_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ResilienceError, match="No goodput ledger"):
        summarize(tmp_path)


def test_sigkill_then_resume_accounts_lost_progress(tmp_path: Path) -> None:
    first = subprocess.Popen(
        [sys.executable, str(WORKERS / "goodput_worker.py"), str(tmp_path), "-1", "30", "--hang"],
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert first.stdout is not None
        line = first.stdout.readline()
        assert line.strip() == "reached 30", line + first.stdout.read()
    finally:
        kill_tree(first)
        first.wait(timeout=30)
    assert first.returncode == -9
    killed_file = tmp_path / "goodput" / "incarnation-000000.jsonl"
    with open(killed_file, "a") as handle:  # a kill in the middle of a write leaves a torn last line
        handle.write('{"e":"span","t0":17000')

    second = GoodputLedger(tmp_path, process_start=time.time())  # the restarted process
    assert train(second, 20, 15) == 35
    second.end()

    summary = summarize(tmp_path)
    killed, resumed = summary.incarnations
    assert summary.skipped_lines == 1
    assert killed.end_reason is None and killed.failed and killed.last_step == 30
    assert resumed.restored_step == 20 and resumed.redone_steps == 10 and resumed.last_step == 35
    # One span per step in the worker: the lost time is exactly the productive time of steps 21-30.
    records, _ = read_events(killed_file)
    redone = [r["s"]["productive"] for r in records if r["e"] == "span" and r.get("first_step", 0) > 20]
    assert len(redone) == 10
    assert killed.lost_s == pytest.approx(sum(redone)) and killed.lost_s >= 10 * STEP_S
    assert summary.buckets["lost"] == pytest.approx(killed.lost_s)
    assert sum(summary.buckets.values()) == pytest.approx(summary.wall_s)
    # The ledger dates each incarnation from its process start, so interpreter and imports count as startup.
    start = json.loads(killed_file.read_text().splitlines()[0])
    assert start["t"] < start["ledger_t"] and killed.buckets["startup"] > 0
    assert resumed.downtime_before_s > 0 and summary.buckets["restore"] >= RESTORE_S


def test_the_first_step_is_noted_once_per_incarnation_not_once_per_span(tmp_path: Path) -> None:
    clock = FakeClock(1_000.0)
    ledger = clock.ledger(tmp_path, span_s=5.0)
    clock.now += 3.0
    ledger.startup_done()
    for step in range(11, 41):
        clock.now += 1.0
        ledger.step_end(step)
    ledger.end()
    assert ledger.path is not None
    records, _ = read_events(ledger.path)
    noted = [r for r in records if r["e"] == "first_step"]
    assert [(r["step"], r["seconds"]) for r in noted] == [(11, 1.0)]
