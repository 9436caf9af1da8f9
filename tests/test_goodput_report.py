"""`resilience report`: the table, the JSON summary and the timeline PNG of a run with restarts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilience.cli import main as cli
from resilience.goodput.summary import BUCKETS
from tests.helpers import WORKERS, base_env, kill_tree
from tests.workers.goodput_sim import incarnation


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Killed at step 120, resumed at 100 after 5 min down, preempted at 250, resumed at 250, finished."""
    t = incarnation(tmp_path, 1_700_000_000.0, restore=None, steps=120, wait_s=0.1, save_every=50, end=None)
    t = incarnation(tmp_path, t + 300, restore=100, steps=150, wait_s=0.1, save_every=50, end="preempted")
    incarnation(tmp_path, t + 60, restore=250, steps=200, wait_s=0.1, save_every=50)
    return tmp_path


def test_json_summary(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["report", str(run_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["buckets"]) == list(BUCKETS)
    assert sum(data["buckets"].values()) == pytest.approx(data["wall_s"])
    assert sum(data["buckets_pct"].values()) == pytest.approx(100.0)
    assert data["goodput_pct"] == pytest.approx(100 * data["buckets"]["productive"] / data["wall_s"])
    assert data["buckets"]["lost"] == pytest.approx(20.0) and data["buckets"]["downtime"] == pytest.approx(360.0)
    assert data["failures"] == 2 and data["observed_mtbf_s"] == pytest.approx(data["uptime_s"] / 2)
    rows = data["incarnations"]
    assert [(r["restored_step"], r["redone_steps"], r["last_step"]) for r in rows] == [
        (0, 0, 120),
        (100, 20, 250),
        (250, 0, 450),
    ]
    assert [r["end_reason"] for r in rows] == [None, "preempted", "completed"]


def test_table_and_png(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "timeline.png"
    assert cli(["report", str(run_dir / "goodput"), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Goodput ") and "3 incarnation(s), 2 failure(s)" in out
    for label in ("productive steps", "lost progress", "checkpoint stall", "downtime", "killed (no end record)"):
        assert label in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(str(png)).shape
    assert width > 1000 and height > 400


def test_a_restore_shows_where_its_bytes_were_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A node lost whole and restored from its peers' memory: the recovery table says so, largest place first."""
    t = incarnation(tmp_path, 1_700_000_000.0, restore=None, steps=60, save_every=50, end=None)
    read = {"from_peers_bytes": 3 * 2**30, "from_disk_bytes": 2**20, "from_durable_bytes": 0.0}
    incarnation(tmp_path, t + 30, restore=50, steps=10, restore_parts={"read_s": 2.0, **read})
    assert cli(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith("READ FROM"))
    assert lines[header + 1].endswith("  peers 3.0 GiB, disk 1.0 MiB, durable 0 B"), lines[header : header + 2]
    assert cli(["report", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["incarnations"]
    assert [r["read_from"] for r in rows] == [{}, {"peers": 3 * 2**30, "disk": 2**20, "durable": 0.0}]


def test_missing_matplotlib_names_the_extra(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # a missing extra is an error of the set-up (4), not of the run
    assert cli(["report", str(run_dir), "--plot", str(tmp_path / "x.png")]) == 4
    assert "pip install 'training-resilience[report]'" in capsys.readouterr().err


def test_no_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["report", str(tmp_path)]) == 3  # no run there
    assert "no goodput ledger" in capsys.readouterr().err


def worker(run_dir: Path, restore: int, steps: int, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKERS / "goodput_worker.py"), str(run_dir), str(restore), str(steps), *flags],
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_a_kill_between_spans_reports_the_step_reached_and_the_steps_redone(tmp_path: Path) -> None:
    """A run killed with SIGKILL at step 46, 10 s spans (the default) apart: the report said "reached 9", redone 0,
    lost 0, as the last span written was all it read, though the next incarnation trained steps 41-46 again.
    The step reached at the kill and the time since the last span reach the ledger at every step."""
    killed_at, resumed_at = 46, 40
    first = worker(tmp_path, -1, 100_000, "--span-s", "10", "--progress")
    try:
        assert first.stdout is not None
        seen = [first.stdout.readline() for _ in range(killed_at)]
        assert seen[-1].strip() == f"step {killed_at}", seen[-3:]
    finally:
        kill_tree(first)
        first.wait(timeout=30)
    assert first.returncode == -9
    second = worker(tmp_path, resumed_at, 10)
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0 and out.strip() == f"reached {resumed_at + 10}", out

    ran = subprocess.run(
        [sys.executable, "-m", "resilience.cli", "report", str(tmp_path), "--json"],
        env=base_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(ran.stdout)
    killed, resumed = report["incarnations"]
    assert killed["end_reason"] is None and killed["failed"]
    # It went on for a few steps between our reading "step 46" and the kill: the ledger has what it reached.
    assert killed["last_step"] is not None and killed_at <= killed["last_step"] < killed_at + 50, killed
    assert resumed["restored_step"] == resumed_at
    assert resumed["redone_steps"] == killed["last_step"] - resumed_at
    assert killed["lost_s"] > 0 and report["buckets"]["lost"] == pytest.approx(killed["lost_s"])
    assert killed["buckets"]["productive"] > 0
    assert sum(report["buckets"].values()) == pytest.approx(report["wall_s"])
