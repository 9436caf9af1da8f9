"""Two jobs on one durable URL or one local root: neither may delete, overwrite or mix the other's steps.

Real jobs (subprocesses, each its own local root) share a ``file://`` URL and a moto S3 URL, concurrently and
one after another; the lease, its fencing, retention's own-steps rule and the owner records' beat are also
checked one by one, in process, against real files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilience import CheckpointConfig, CheckpointError, CheckpointManager, ConfigError
from resilience.recovery import beats
from resilience.storage.catalog import scan, verify
from resilience.storage.fencing import DurableGuard
from resilience.storage.lease import Lease, generations, read_beat
from resilience.storage.manifest import Manifest
from resilience.storage.owners import Owner, Owners
from resilience.storage.retention import steps_to_delete
from resilience.storage.tiers import DurableTier, LocalTier
from tests.helpers import WORKERS, base_env, edit_manifest, kill_tree

WORKER = WORKERS / "shared_storage_worker.py"
FAST = {"TEST_BEAT_S": "0.2", "TEST_WATCH_S": "3"}


@pytest.fixture(autouse=True)
def quick_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beats and watches of tenths of seconds, so a gone owner is found in about a second."""
    monkeypatch.setattr(beats, "BEAT_S", 0.1)
    monkeypatch.setattr(beats, "WATCH_S", 1.0)


def state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 64, generator=gen)}, "step": step}


def manager(local: Path, url: str, options: dict[str, object] | None = None, **kw: object) -> CheckpointManager:
    kw.setdefault("keep_last", 2)
    kw.setdefault("persist", "thread")
    config = CheckpointConfig(local, durable_url=url, storage_options=options or {}, **kw)  # type: ignore[arg-type]
    return CheckpointManager(config)


def stranger(run_id: str = "otherrun", *, machine: str = "another-machine") -> Owner:
    """An owner on another machine: its pid cannot be looked up here, only its beat watched."""
    return Owner("elsewhere", 4242, None, run_id, time.time() - 3600, machine=machine)


@contextlib.contextmanager
def beating(lease: Lease) -> Iterator[None]:
    """``lease``'s holder lives meanwhile: its beat moves every ``BEAT_S``, as its heartbeat would move it."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(beats.BEAT_S):
            lease.beat()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def durable_steps(tier: DurableTier) -> dict[int, Manifest]:
    """Every committed step of the tier, each verified in full (sizes and checksums)."""
    found = {}
    for entry in scan(tier):
        if entry.manifest is not None:
            verify(entry, full=True)
            found[entry.step] = entry.manifest
    return found


def start(mode: str, local: Path, url: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(local), url],
        env=base_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_line(proc: subprocess.Popen[str], word: str, timeout: float = 120) -> str:
    """The first line of ``proc``'s output that starts with ``word`` (log lines may come before it)."""
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(word):
            return line
        seen.append(line)
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {word} line from the worker; it wrote:\n{''.join(seen)}")


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_tree(proc)
    return proc.returncode, out


@pytest.fixture(params=["file", "s3"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, object]]]:
    if request.param == "s3":
        s3 = request.getfixturevalue("s3")
        yield str(s3["url"]), dict(s3["options"])
    else:
        yield f"file://{tmp_path / 'shared'}", {}


# ---- two real jobs at once ------------------------------------------------------------------------------------


@pytest.mark.parametrize("machines", ["one machine", "two machines"])
def test_two_jobs_started_together_on_one_url_one_is_stopped_and_the_other_keeps_every_step(
    tmp_path: Path, shared_url: tuple[str, dict[str, object]], machines: str
) -> None:
    """Neither has uploaded when both claim. On one machine the loser sees the winner's process; on two it
    watches the winner's beat. Either way the loser stops with the clear error (or is fenced before it writes),
    and the winner's steps all verify, with nothing of the loser's in them."""
    url, options = shared_url
    go = tmp_path / "go"
    procs = []
    for name in ("a", "b"):
        env = {**FAST, "TEST_GO_FILE": str(go), "TEST_STEPS": "1,2,3,4", "TEST_STORAGE_OPTIONS": json.dumps(options)}
        if machines == "two machines":
            env["TEST_MACHINE"] = f"machine-{name}"
        procs.append(start("race", tmp_path / name, url, env))
    time.sleep(0.5)
    go.touch()
    results = [finish(proc) for proc in procs]
    winners = [out for code, out in results if code == 0]
    losers = [out for code, out in results if code == 3]
    assert len(winners) == 1 and len(losers) == 1, results
    assert "in use by another live job" in losers[0] or "was taken over" in losers[0], losers[0]
    if machines == "two machines":
        # it could not look the winner's process up (or, where two claims raced, it was fenced before it wrote)
        assert "watching its beat" in losers[0] or "was taken over" in losers[0], losers[0]
    run_id = winners[0].split("SAVED", 1)[1].split()[0]
    tier = DurableTier(url, options)
    committed = durable_steps(tier)
    assert sorted(committed) == [3, 4], committed  # keep_last=2 of the winner's own four
    assert {m.run_id for m in committed.values()} == {run_id}
    assert not [e for e in scan(tier) if e.manifest is None], "no step directory of the loser's in the URL"


# ---- one after another ------------------------------------------------------------------------------------------


def test_a_fresh_run_on_a_url_holding_another_runs_steps_is_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'shared'}"
    with manager(tmp_path / "a", url) as first:
        for step in (1, 2):
            first.save(step, state(step))
        first.wait(durable=True)
    with manager(tmp_path / "b", url) as second, pytest.raises(ConfigError, match="already holds checkpoints"):
        second.save(1, state(1))
    tier = DurableTier(url)
    assert sorted(durable_steps(tier)) == [1, 2]
    assert generations(tier) == [1, 2] and read_beat(tier, 2)[1], "the refused job released the URL as it closed"


def test_a_relaunch_of_the_same_run_takes_over_at_once_and_the_old_process_is_fenced(
    tmp_path: Path, shared_url: tuple[str, dict[str, object]]
) -> None:
    """The old process still lives (a zombie a scheduler lost track of) when the run is relaunched on another
    node: the relaunch resumes the run, so it takes the lease without waiting; the old one's next upload fails
    with the clear error and neither overwrites nor deletes what the relaunch committed."""
    url, options = shared_url
    hold = tmp_path / "hold"
    env = {
        "TEST_STEPS": "1,2",
        "TEST_MORE_STEPS": "3",
        "TEST_HOLD_FILE": str(hold),
        "TEST_STORAGE_OPTIONS": json.dumps(options),
    }
    old = start("hold", tmp_path / "old", url, env)
    try:
        run_id = wait_line(old, "HELD").split()[1]
        with manager(tmp_path / "new", url, options) as relaunch:
            restored = relaunch.load()
            assert restored is not None and restored.step == 2
            assert relaunch.claim(resumed_from=2) == run_id  # the old process lives: another run would be refused
            relaunch.save(3, state(3))
            assert relaunch.wait(durable=True)
            hold.touch()
            code, out = finish(old)
    finally:
        kill_tree(old)
    assert code == 3 and "was taken over" in out and "step=3, tier=durable" in out, out
    committed = durable_steps(DurableTier(url, options))
    assert sorted(committed) == [2, 3]
    with manager(tmp_path / "check", url, options) as reader:
        again = reader.load()
    assert again is not None and again.step == 3 and again.tier == "durable"
    assert torch.equal(again.state["model"]["w"], state(3)["model"]["w"])  # type: ignore[index]


def test_a_predecessor_that_died_before_committing_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On this machine its process is looked up (no wait); on another, its beat is watched for the window."""
    monkeypatch.setattr(beats, "WATCH_S", 2.0)
    url = f"file://{tmp_path / 'shared'}"
    tier = DurableTier(url)
    env = {"TEST_STEPS": "", "TEST_MORE_STEPS": "", "TEST_HOLD_FILE": str(tmp_path / "never")}
    victim = start("hold", tmp_path / "victim", url, env)
    try:
        wait_line(victim, "HELD")
    finally:
        kill_tree(victim)  # SIGKILL: it never releases its lease
        victim.wait()
    assert generations(tier) == [1] and not read_beat(tier, 1)[1]
    with manager(tmp_path / "a", url) as first:
        began = time.monotonic()
        first.claim()
        assert time.monotonic() - began < beats.WATCH_S, "a dead process on this machine needs no watching"
        first.save(1, state(1))
        assert first.wait(durable=True)

    shutil.rmtree(tmp_path / "shared")
    Lease(tier, stranger("deadrun")).acquire()  # its beat never moves
    with manager(tmp_path / "b", url) as second:
        began = time.monotonic()
        second.claim()
        assert time.monotonic() - began >= beats.WATCH_S
        second.save(1, state(1))
        assert second.wait(durable=True)
    assert generations(tier) == [1, 2] and sorted(durable_steps(tier)) == [1]


def test_a_live_holder_on_another_machine_is_seen_by_its_beat(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'shared'}"
    tier = DurableTier(url)
    other = Lease(tier, stranger())
    other.acquire()
    with beating(other), manager(tmp_path / "a", url) as m, pytest.raises(ConfigError, match="in use by another live"):
        m.save(1, state(1))
    assert generations(tier) == [1] and not (tmp_path / "shared" / "step-1").exists()
    other.release()
    with manager(tmp_path / "b", url) as m:  # released: taken at once
        m.save(1, state(1))
        assert m.wait(durable=True)
    assert read_beat(tier, 2)[1], "a closed job releases its lease"


def test_a_resting_engine_lets_the_url_go_and_takes_it_back_at_its_next_save(tmp_path: Path) -> None:
    """At rest (Lightning's engine after ``fit()``) no thread beats, so the lease is released; the next save
    takes it back, judging whoever holds it then like a job that starts."""
    url = f"file://{tmp_path / 'shared'}"
    tier = DurableTier(url)
    with manager(tmp_path / "a", url, persist="process") as m:
        m.save(1, state(1))
        assert m.wait(durable=True) and m.rest()
        assert read_beat(tier, 1)[1], "released at rest"
        other = Lease(tier, stranger())
        other.acquire()  # taken at once
        with beating(other), pytest.raises(ConfigError, match="in use by another live job"):
            m.save(2, state(2))
        other.release()
        handle = m.save(2, state(2))
        assert handle is not None and handle.durable.result(60) is not None
    assert generations(tier) == [1, 2, 3] and sorted(durable_steps(tier)) == [1, 2]


# ---- fencing ------------------------------------------------------------------------------------------------


def test_a_job_whose_lease_was_taken_fails_its_next_durable_commit_and_deletes_nothing(tmp_path: Path) -> None:
    """In its helper process (where uploads and retention run): the commit is refused with the clear error, the
    local commit stays, and retention removes nothing from the durable tier."""
    url = f"file://{tmp_path / 'shared'}"
    tier = DurableTier(url)
    protected = {1, 2, 3}
    config = CheckpointConfig(tmp_path / "a", durable_url=url, keep_last=2, persist="process")
    with CheckpointManager(config, protected_steps=lambda: set(protected)) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
            assert m.wait(durable=True)
        Lease(tier, stranger(m.run_id)).acquire()  # a relaunch of this run elsewhere took the URL at once
        handle = m.save(4, state(4))
        assert handle is not None and handle.committed.result(60).step == 4
        with pytest.raises(CheckpointError, match=r"was taken over by another job \(pid 4242 on elsewhere"):
            handle.durable.result(60)
        assert m.pipeline.take_errors(), "raised at the next save"
        protected.clear()
        m.drain()  # retention runs: it would delete steps 1 and 2 from both tiers
    assert sorted(p.name for p in (tmp_path / "a").glob("step-*")) == ["step-3", "step-4"], "local retention ran"
    assert sorted(durable_steps(tier)) == [1, 2, 3], "nothing deleted from the durable tier"
    assert not (tmp_path / "shared" / "step-4").exists(), "nothing of step 4 uploaded"


def test_a_committed_step_is_never_written_into_and_an_abandoned_upload_is_cleared(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'shared'}"
    tier, shared = DurableTier(url), tmp_path / "shared"
    with manager(tmp_path / "src", url) as m:  # a real committed step
        m.save(7, state(7))
        assert m.wait(durable=True)
    mine = Owner.me("myrun")
    try:
        Lease(tier, mine).acquire()  # the manager released the URL at close
        guard = DurableGuard(tier)
        with pytest.raises(CheckpointError, match=r"already committed.*never overwritten"):
            guard.open_step(7, mine.to_json())
        shutil.copytree(shared / "step-7", shared / "step-8")
        (shared / "step-8" / "manifest.json").unlink()
        (shared / "step-8" / ".writer.json").write_text(json.dumps(stranger().to_json()))
        guard.open_step(8, mine.to_json())
        assert sorted(p.name for p in (shared / "step-8").iterdir()) == [".writer.json"]
        assert Owner.from_json(json.loads((shared / "step-8" / ".writer.json").read_text())) == mine
        manifest = Manifest.from_json((shared / "step-7" / "manifest.json").read_bytes(), where="step-7")
        with pytest.raises(CheckpointError, match="another process wrote into this step"):
            guard.check_uploaded(8, manifest)  # nothing of it there
        shard = next((shared / "step-7").glob("*.distcp"))
        with open(shard, "ab") as handle:
            handle.write(b"x")  # another writer's bytes in a file of the step
        with pytest.raises(CheckpointError, match="another process wrote into this step"):
            guard.check_uploaded(7, manifest)
    finally:
        mine.release()


# ---- retention ------------------------------------------------------------------------------------------------


def test_retention_neither_counts_nor_deletes_another_runs_steps() -> None:
    mine, theirs = [10, 20, 30, 40], [5, 35, 50]
    assert steps_to_delete(mine + theirs, [], keep_last=2, keep_every=None) == [5, 10, 20, 30, 35]
    assert steps_to_delete(mine + theirs, [1, 45], keep_last=2, keep_every=None, foreign=[*theirs, 1]) == [10, 20]
    assert steps_to_delete(theirs, [1], keep_last=2, keep_every=None, foreign=theirs) == []


def test_retention_in_both_tiers_keeps_another_runs_steps(tmp_path: Path) -> None:
    """Another run's committed steps (older and newer than this run's) and its unfinished upload are left where
    they are, and this run still keeps its own ``keep_last`` newest."""
    url = f"file://{tmp_path / 'shared'}"
    shared, local = tmp_path / "shared", tmp_path / "a"
    with manager(local, url) as m:
        m.save(1, state(1))
        assert m.wait(durable=True)
        for where in (shared, local):
            for step in (0, 100):
                shutil.copytree(where / "step-1", where / f"step-{step}")
                edit_manifest(where / f"step-{step}", lambda body, s=step: body.update(step=s, run_id="otherrun"))
        shutil.copytree(shared / "step-1", shared / "step-50")
        (shared / "step-50" / "manifest.json").unlink()
        (shared / "step-50" / ".writer.json").write_text(json.dumps(stranger().to_json()))
        for step in (2, 3, 4):
            m.save(step, state(step))
            assert m.wait(durable=True)
    assert sorted(p.name for p in shared.glob("step-*")) == ["step-0", "step-100", "step-3", "step-4", "step-50"]
    assert sorted(p.name for p in local.glob("step-*")) == ["step-0", "step-100", "step-3", "step-4"]
    for step in (0, 100):
        verify(next(e for e in scan(LocalTier(shared)) if e.step == step), full=True)


# ---- a local root seen from two machines --------------------------------------------------------------------


def _plant_owner(root: Path, owner: Owner, beat: int, *, stamp: float) -> Path:
    """Write ``owner``'s record as its machine would, with that machine's clock at ``stamp``."""
    path = root / ".owners" / f"{owner.id}.{owner.token}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**owner.to_json(), "beat": beat}))
    os.utime(tmp, (stamp, stamp))
    os.replace(tmp, path)
    return path


def test_an_owner_on_another_machine_is_alive_while_its_beat_moves_whatever_its_files_time(tmp_path: Path) -> None:
    """Its record's modification time is a day in the past (its clock, or ours, is off): the beat still moves,
    so the root is refused, not taken over."""
    root = tmp_path / "root"
    owner = stranger()
    day_ago = time.time() - 86400
    path = _plant_owner(root, owner, 0, stamp=day_ago)
    stop = threading.Event()

    def beat() -> None:
        count = 0
        while not stop.wait(beats.BEAT_S):
            count += 1
            _plant_owner(root, owner, count, stamp=day_ago)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        with manager(root, f"file://{tmp_path / 'shared'}") as m, pytest.raises(ConfigError, match="in use by another"):
            m.save(1, state(1))
    finally:
        stop.set()
        thread.join()
    assert path.exists() and not (root / "step-1").exists()


def test_an_owner_on_another_machine_whose_beat_stopped_is_taken_over_even_with_a_future_time(tmp_path: Path) -> None:
    """A record touched "a day from now" (a fast clock) whose beat does not move: gone. Its record and its
    unfinished step directory are removed, and this job saves."""
    root = tmp_path / "root"
    owner = stranger()
    path = _plant_owner(root, owner, 7, stamp=time.time() + 86400)
    leftover = root / "step-5"
    leftover.mkdir()
    (leftover / ".writer.json").write_text(json.dumps(owner.to_json()))
    began = time.monotonic()
    with manager(root, f"file://{tmp_path / 'shared'}") as m:
        m.save(1, state(1))
        assert m.wait(durable=True)
    assert time.monotonic() - began >= beats.WATCH_S
    assert not path.exists() and not leftover.exists()
    assert Owners(str(root)).live_others() == []
