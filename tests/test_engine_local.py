"""The engine in one process against real local files: commit, retention, discovery, fallback, policies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from resilience import (
    CheckpointConfig,
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    NoCheckpointError,
)
from resilience.checkpoint import shm, staging_area
from resilience.checkpoint.staging import SEGMENTS
from resilience.cli import main as cli
from resilience.persist.pipeline import Pipeline
from resilience.storage.processes import process_start_ticks
from resilience.storage.tiers import LocalTier
from tests.helpers import base_env


def make_state(step: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(256, 64, generator=gen), "b": torch.randn(64, generator=gen)},
        "step": step,
    }


def manager(root: Path, **kw: object) -> CheckpointManager:
    kw.setdefault("keep_last", 2)
    return CheckpointManager(CheckpointConfig(root, **kw))  # type: ignore[arg-type]


def test_save_commit_load_roundtrip(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        handle = m.save(5, make_state(5), {"rng": torch.get_rng_state()})
        assert handle is not None and handle.committed.result(30).step == 5
    manifest = json.loads((tmp_path / "step-5" / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["world_size"] == 1
    assert {f["kind"] for f in manifest["files"]} == {"shard", "dcp-metadata", "state"}
    for entry in manifest["files"]:
        assert (tmp_path / "step-5" / entry["path"]).stat().st_size == entry["size"]
    with manager(tmp_path) as m:
        restored = m.load()
    assert restored is not None and restored.step == 5 and restored.state["step"] == 5
    assert torch.equal(restored.state["model"]["w"], make_state(5)["model"]["w"])
    assert torch.equal(restored.rank_state["rng"], torch.get_rng_state())


def test_load_into_target_fills_it_in_place(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        m.save(1, make_state(1))
    target = make_state(99)
    with manager(tmp_path) as m:
        restored = m.load(target)
    assert restored is not None
    assert restored.state["model"]["w"] is target["model"]["w"]  # type: ignore[index]
    assert torch.equal(target["model"]["w"], make_state(1)["model"]["w"])  # type: ignore[index]
    bad_target = {"model": {"w": torch.zeros(256, 64), "extra": torch.zeros(1)}}
    with manager(tmp_path) as m, pytest.raises(CheckpointError, match="no tensor for 1 key"):
        m.load(bad_target)


def test_tensors_without_a_target_are_taken_as_read_and_given_ones_filled_in_place(tmp_path: Path) -> None:
    """DCP reads a tensor into new memory and copies it into its target: for a target the loader made itself that
    copy (and the memory it fills) is skipped, and the tensor read is the result; a caller's target, or one read in
    pieces, is filled in place as before."""
    from resilience.checkpoint.loader import read_tensors
    from resilience.checkpoint.safe_reads import load_dcp_metadata
    from resilience.storage import catalog

    state = {"big": torch.randn(300, 300), "tiny": torch.arange(5.0), "half": torch.randn(4, 8)}
    with manager(tmp_path) as m:
        m.save(1, state)
    (entry,) = [e for e in catalog.scan(LocalTier(tmp_path)) if e.committed]
    metadata = load_dcp_metadata(entry)
    placeholder, given = torch.empty(300, 300), torch.zeros(4, 8)
    tensors = {"big": placeholder, "half": given}
    read_tensors(entry, metadata, tensors, adopt={"big"})
    assert tensors["big"] is not placeholder and torch.equal(tensors["big"], state["big"])
    assert tensors["half"] is given and torch.equal(given, state["half"])
    with manager(tmp_path) as m:  # the whole load gives the saved values
        restored = m.load()
    assert restored is not None
    assert all(torch.equal(restored.state[key], value) for key, value in state.items())  # type: ignore[index]


def test_a_large_tensor_without_a_target_is_read_into_memory_of_its_own_on_a_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the page cache, bytes can go from the device straight into memory that starts on a block: a large
    tensor's record is read there (no copy out of a bounce buffer), and that memory becomes the tensor; what is
    small, sliced or given a target is read as before. Nothing runs torch.load for the large one."""
    from resilience.checkpoint import loader
    from resilience.persist.direct_io import ALIGN

    state = {"large": torch.randn(700, 700), "wide": torch.randn(3, 700, 300).double(), "small": torch.randn(10)}
    with manager(tmp_path) as m:
        m.save(1, state)
    loads: list[object] = []
    real_load = torch.load

    def counted(*args: object, **kwargs: object) -> object:
        loads.append(args[0])
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loader.torch, "load", counted)
    with manager(tmp_path) as m:
        restored = m.load()
    assert restored is not None
    for key in ("large", "wide"):
        tensor = restored.state[key]  # type: ignore[index]
        assert torch.equal(tensor, state[key]) and tensor.dtype == state[key].dtype
        assert tensor.data_ptr() % ALIGN == 0 and tensor.is_contiguous()
    assert torch.equal(restored.state["small"], state["small"])  # type: ignore[index]
    assert len(loads) == 1, "only the small tensor goes through torch.load"


def test_a_load_target_made_on_demand_and_top_level_keys_left_out(tmp_path: Path) -> None:
    made: list[int] = []

    def target() -> dict[str, object]:
        made.append(1)
        return {"model": {"w": torch.zeros(256, 64)}}

    with manager(tmp_path) as m:
        assert m.load(target) is None and not made  # nothing to load: the target is never made
        m.save(1, make_state(1))
    with manager(tmp_path) as m:
        restored = m.load(target, leave_out=("model",))
    assert restored is not None and made == [1]
    assert restored.state == {"step": 1}  # "model" was neither read nor allocated


def test_nothing_saved_loads_none_and_missing_step_is_an_error(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        assert m.load() is None
        with pytest.raises(NoCheckpointError, match="step 3"):
            m.load(step=3)


def test_committed_step_is_never_overwritten(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        m.save(1, make_state(1))
        with pytest.raises(CheckpointExistsError, match="never overwritten"):
            m.save(1, make_state(2))
    before = (tmp_path / "step-1" / "manifest.json").read_bytes()
    with manager(tmp_path) as m:
        m.load()
        with pytest.raises(CheckpointExistsError):
            m.save(1, make_state(3))
    assert (tmp_path / "step-1" / "manifest.json").read_bytes() == before
    with manager(tmp_path) as m:
        restored = m.load()
    assert restored is not None and torch.equal(restored.state["model"]["w"], make_state(1)["model"]["w"])


def test_retention_keeps_last_and_milestones(tmp_path: Path) -> None:
    with manager(tmp_path, keep_last=2, keep_every=20) as m:
        for step in range(10, 70, 10):
            m.save(step, make_state(step))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-20", "step-40", "step-50", "step-60"]


def test_host_buffers_are_reused_across_saves(tmp_path: Path) -> None:
    with manager(tmp_path, keep_last=2) as m:
        m.save(1, make_state(1))
        m.wait()
        buffers = {k: v.data_ptr() for k, v in m._staging_area.sets[0].stager._buffers.items()}
        for step in range(2, 6):
            m.save(step, make_state(step))
            m.wait()
        assert {k: v.data_ptr() for k, v in m._staging_area.sets[0].stager._buffers.items()} == buffers


@pytest.mark.parametrize("numel", [1000, 300_000])
def test_a_buffer_made_anew_for_another_shape_reaches_the_helper(tmp_path: Path, numel: int) -> None:
    """The new buffer may be mapped where the old one was: the helper must be told by segment, not address."""
    with manager(tmp_path, keep_last=3, persist="process") as m:
        for step, extra in ((1, 0), (2, 64), (3, 0)):
            m.save(step, {"w": torch.arange(float(numel + extra))})
            m.wait()
        for step, extra in ((1, 0), (2, 64), (3, 0)):
            restored = m.load(step=step)
            assert restored is not None and torch.equal(restored.state["w"], torch.arange(float(numel + extra)))


def test_async_staging_saves_the_values_at_save_time(tmp_path: Path) -> None:
    state = make_state(1)
    with manager(tmp_path, async_staging=True) as m:
        m.save(1, state)
        m.wait_for_staging()
        state["model"]["w"].add_(100.0)  # type: ignore[index]  # a later optimizer step
        m.wait()
    with manager(tmp_path) as m:
        restored = m.load()
    assert restored is not None
    assert torch.equal(restored.state["model"]["w"], make_state(1)["model"]["w"])


def gated_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    gate = threading.Event()
    original = Pipeline._write

    def slow(self: Pipeline, job: object) -> None:
        gate.wait(30)
        original(self, job)

    monkeypatch.setattr(Pipeline, "_write", slow)
    return gate


def test_busy_skip_policy_skips_and_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_area, "MAX_SETS", 2)
    gate = gated_writer(monkeypatch)  # in this process: the persist path runs as threads here
    with manager(tmp_path, when_busy="skip", persist="thread", keep_last=3) as m:
        assert m.save(1, make_state(1)) is not None
        assert m.save(2, make_state(2)) is not None  # a small state: staged in a second set of buffers
        assert m.save(3, make_state(3)) is None  # both sets held by saves not yet written
        gate.set()
        m.wait()
        assert m.save(4, make_state(4)) is not None
        assert m.stats.skipped == 1
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-1", "step-2", "step-4"]


def test_a_small_state_is_staged_beside_saves_still_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to MAX_SETS saves of a small state are staged while none is written yet, each in buffers of its own,
    none waiting; the next waits for the oldest (``when_busy="wait"``). Each step holds its own values."""
    gate = gated_writer(monkeypatch)
    many = staging_area.MAX_SETS
    with manager(tmp_path, when_busy="wait", persist="thread", keep_last=many + 1) as m:
        handles = [m.save(step, make_state(step)) for step in range(1, many + 1)]
        assert not any(h is None or h.committed.done() for h in handles)
        assert m.stats.waited_for_previous == 0 and len(m._staging_area.sets) == many
        threading.Timer(0.3, gate.set).start()
        last = m.save(many + 1, make_state(many + 1))
        assert handles[0] is not None and handles[0].committed.done(), "a save copied into buffers still unwritten"
        assert last is not None and m.stats.waited_for_previous == 1
        m.wait()
    with manager(tmp_path, keep_last=many + 1) as m:
        for step in range(1, many + 2):
            restored = m.load(step=step)
            assert restored is not None and torch.equal(restored.state["model"]["w"], make_state(step)["model"]["w"])


@pytest.mark.parametrize(("limit", "value", "sets"), [("SETS_BYTES", 1024, 1), ("SETS_BUFFERS", 3, 2)])
def test_a_state_of_many_bytes_or_tensors_gets_few_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, value: int, sets: int
) -> None:
    """Past SETS_BYTES a state gets one set of buffers (a second would double its host memory); a state of many
    tensors gets as many sets as SETS_BUFFERS allows (each buffer is a segment the helper maps): here 2 of 2
    tensors. The save after those sets are held waits for the oldest commit."""
    monkeypatch.setattr(staging_area, limit, value)
    gate = gated_writer(monkeypatch)
    with manager(tmp_path, when_busy="wait", persist="thread", keep_last=sets + 1) as m:
        first, *_ = [m.save(step, make_state(step)) for step in range(1, sets + 1)]
        assert m.stats.waited_for_previous == 0
        threading.Timer(0.3, gate.set).start()
        last = m.save(sets + 1, make_state(sets + 1))
        assert first is not None and first.committed.done(), "a save copied into buffers still unwritten"
        assert last is not None and m.stats.waited_for_previous == 1
        assert len(m._staging_area.sets) == sets


@pytest.mark.parametrize("persist", ["process", "thread"])
def test_background_failure_surfaces_with_context_and_leaves_no_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persist: str
) -> None:
    monkeypatch.setenv("RESILIENCE_HELPER_PRELOAD", "tests.workers.helper_faults")  # where the write runs
    monkeypatch.setenv("TEST_HELPER_FAULT", "fail_write")
    if persist == "thread":
        from resilience.persist import pipeline

        def disk_full(self: object, plan: object, planner: object) -> object:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(pipeline.RecordingWriter, "write_data", disk_full)
    m = manager(tmp_path, persist=persist)
    m.save(4, make_state(4))
    with pytest.raises(CheckpointError, match=r"No space left on device.*step=4, tier=local"):
        m.wait()
    m.close()
    assert not (tmp_path / "step-4" / "manifest.json").exists()


@pytest.mark.parametrize("persist", ["process", "thread"])
def test_a_script_that_ends_right_after_a_save_commits_and_uploads_it(tmp_path: Path, persist: str) -> None:
    """The script returns while the save's local write is still running, so its upload starts during interpreter
    shutdown: the exit waits for the commit and the upload (a thread pool refused the upload there once)."""
    script = f"""
import torch
from resilience import CheckpointConfig, CheckpointManager
durable = {(tmp_path / "durable").as_uri()!r}
config = CheckpointConfig({str(tmp_path / "local")!r}, durable_url=durable, persist={persist!r})
CheckpointManager(config).save(1, {{"w": torch.ones(16, 1024, 1024)}})
"""
    done = subprocess.run([sys.executable, "-c", script], env=base_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "waiting for checkpoint step(s) [1] to commit" in done.stdout, "the save was done before the exit"
    assert "failed" not in done.stderr, done.stderr
    with CheckpointManager(CheckpointConfig(tmp_path / "elsewhere", durable_url=(tmp_path / "durable").as_uri())) as m:
        restored = m.load()
    assert (
        restored is not None
        and restored.tier == "durable"
        and torch.equal(restored.state["w"], torch.ones(16, 1024, 1024))
    )


@pytest.mark.parametrize("persist", ["process", "thread"])
def test_kill_before_commit_leaves_nothing_discovery_accepts(tmp_path: Path, persist: str) -> None:
    """kill -9 of the training process while its shards are written and the manifest is not (in the helper
    process, or in a thread), then a restart: the partial step is never loaded, and its name is free again."""
    with manager(tmp_path) as m:
        m.save(1, make_state(1))
    script = f"""
import time
from resilience import CheckpointConfig, CheckpointManager
from tests.test_engine_local import make_state
import tests.workers.helper_faults  # the same stall in this process (the thread case)
m = CheckpointManager(CheckpointConfig({str(tmp_path)!r}, keep_last=2, persist={persist!r}))
m.load()
m.save(2, make_state(2))
time.sleep(600)
"""
    env = base_env(
        {
            "RESILIENCE_HELPER_PRELOAD": "tests.workers.helper_faults",
            "TEST_HELPER_FAULT": "stall_manifest",
            "TEST_READY_FILE": str(tmp_path / "ready"),
        }
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "writer never reached the commit"
        time.sleep(0.05)
    proc.kill()  # SIGKILL, between the shard writes and the manifest
    proc.wait()
    assert (tmp_path / "step-2" / ".metadata").exists() and not (tmp_path / "step-2" / "manifest.json").exists()
    with manager(tmp_path) as m:
        restored = m.load()
        assert restored is not None and restored.step == 1
        m.claim(resumed_from=1)
        assert not (tmp_path / "step-2").exists(), "the uncommitted leftover of a dead writer was not cleared"
        m.save(2, make_state(2))  # the step can be saved again after the crash
    with manager(tmp_path) as m:
        restored = m.load()
    assert restored is not None and restored.step == 2


def test_a_job_killed_with_several_saves_in_flight_resumes_from_the_last_commit(tmp_path: Path) -> None:
    """A small state's saves 2, 3 and 4 are all staged while step 2's commit hangs in the helper; the job is then
    killed whole (SIGKILL to its process group, helpers and fork server included, as a launcher does): none of
    them loads, step 1 does, exactly, and step 2 can be saved again."""
    with manager(tmp_path) as m:
        m.save(1, make_state(1))
    script = f"""
import time
from resilience import CheckpointConfig, CheckpointManager
from tests.test_engine_local import make_state
m = CheckpointManager(CheckpointConfig({str(tmp_path)!r}, keep_last=2, persist="process"))
m.load()
handles = [m.save(step, make_state(step)) for step in (2, 3, 4)]
print("STAGED", sum(h is not None and not h.committed.done() for h in handles), flush=True)
time.sleep(600)
"""
    env = base_env(
        {
            "RESILIENCE_HELPER_PRELOAD": "tests.workers.helper_faults",
            "TEST_HELPER_FAULT": "stall_manifest",
            "TEST_READY_FILE": str(tmp_path / "ready"),
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().split() == ["STAGED", "3"]
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never reached the commit"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not any((tmp_path / f"step-{step}" / "manifest.json").exists() for step in (2, 3, 4))
    with manager(tmp_path) as m:
        restored = m.load()
        assert restored is not None and restored.step == 1
        assert torch.equal(restored.state["model"]["w"], make_state(1)["model"]["w"])
        m.claim(resumed_from=1)
        m.save(2, make_state(2))
    with manager(tmp_path) as m:
        restored = m.load()
    assert restored is not None and restored.step == 2


def corrupt_newest_shard(root: Path, step: int, how: str) -> Path:
    shard = next((root / f"step-{step}").glob("__*.distcp"))
    data = bytearray(shard.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    return shard


@pytest.mark.parametrize(("how", "verify"), [("flip", "full"), ("truncate", "size")])
def test_corrupt_checkpoint_is_skipped_with_a_warning_and_quarantined(tmp_path: Path, how: str, verify: str) -> None:
    with manager(tmp_path, keep_last=3) as m:
        for step in (1, 2):
            m.save(step, make_state(step))
    corrupt_newest_shard(tmp_path, 2, how)
    assert cli(["verify", str(tmp_path)]) == 1
    with manager(tmp_path, verify=verify) as m:
        with pytest.warns(UserWarning, match=r"Skipping step 2 .*distcp.*trying step 1"):
            restored = m.load()
        assert restored is not None and restored.step == 1
        assert torch.equal(restored.state["model"]["w"], make_state(1)["model"]["w"])
        assert not (tmp_path / "step-2").exists() and len(list((tmp_path / "quarantine").iterdir())) == 1
        m.save(2, make_state(2))  # the step name is free again; the corrupt copy is kept aside
    assert cli(["verify", str(tmp_path)]) == 0


def test_cli_ls_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with manager(tmp_path) as m:
        m.save(3, make_state(3))
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / "__0_0.distcp").write_bytes(b"partial")
    assert cli(["ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["committed"], r["world_size"]) for r in rows] == [(9, False, None), (3, True, 1)]
    assert cli(["ls", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "incomplete" in table and "committed" in table
    assert cli(["verify", str(tmp_path), "--step", "3"]) == 0
    assert cli(["verify", str(tmp_path), "--step", "9"]) == 3  # an unfinished folder: no checkpoint to check
    assert "SKIP step 9" in capsys.readouterr().out
    assert cli(["verify", str(tmp_path)]) == 0  # every committed step verifies
    assert cli(["verify", str(tmp_path), "--step", "4"]) == 3  # nothing of that step there


def test_tampered_dcp_metadata_is_refused_before_unpickling(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        m.save(1, make_state(1))
    metadata = tmp_path / "step-1" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:-1] + b"X")
    os.utime(metadata)
    with manager(tmp_path) as m, pytest.warns(UserWarning, match=r"\.metadata"):
        assert m.load() is None


@pytest.mark.parametrize(
    ("barrier", "closure"), [("optimizer_step", False), ("optimizer_step", True), ("forward", False)]
)
def test_async_staging_barrier_makes_the_next_state_change_wait(tmp_path: Path, barrier: str, closure: bool) -> None:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    pending_in_closure: list[bool] = []
    with manager(tmp_path, async_staging=True, staging_barrier=barrier) as m:
        m.save(1, {"model": model.state_dict()})
        assert m._staging_area.pending is not None and m._staging_area.barrier_hooks, "a pending copy arms the barrier"

        def forward_backward() -> torch.Tensor:
            pending_in_closure.append(m._staging_area.pending is not None)
            loss = model(torch.ones(2, 64)).sum()
            loss.backward()
            return loss

        if closure:  # Lightning's way: forward and backward run inside step(); the copy overlaps them
            optimizer.step(forward_backward)
            assert pending_in_closure == [True], "the wait must come after the closure, not before it"
        else:
            forward_backward()
            if barrier == "forward":
                assert m._staging_area.pending is None, "the forward must have waited for the copy"
            optimizer.step()  # without calling wait_for_staging(): the hook does it
        assert m._staging_area.pending is None, "the update waited for the copy"
        m.wait()
    assert not m._staging_area.barrier_hooks, "closing removes the hooks"
    with manager(tmp_path) as m:
        restored = m.load()
    assert restored is not None
    for key, value in saved.items():
        assert torch.equal(restored.state["model"][key], value)


def wait_for(condition: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_helper_killed_mid_save_commits_nothing_and_the_next_save_restarts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper process dies between the shard writes and the manifest: that save fails with the cause (never
    committed, never loaded), training goes on, and the next save gets a new helper."""
    import signal

    monkeypatch.setenv("RESILIENCE_HELPER_PRELOAD", "tests.workers.helper_faults")
    monkeypatch.setenv("TEST_HELPER_FAULT", "stall_manifest")
    monkeypatch.setenv("TEST_READY_FILE", str(tmp_path / "ready"))
    with manager(tmp_path / "ckpt") as m:
        handle = m.save(1, make_state(1))
        assert handle is not None
        wait_for((tmp_path / "ready").exists)
        os.kill(m.pipeline.pid, signal.SIGKILL)  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match=r"helper process \(pid \d+\) died"):
            handle.committed.result(60)
        assert not (tmp_path / "ckpt" / "step-1" / "manifest.json").exists()
        monkeypatch.delenv("TEST_HELPER_FAULT")  # the new helper writes normally
        second = m.save(2, make_state(2))
        assert second is not None and second.committed.result(60).step == 2
    with manager(tmp_path / "ckpt") as m:
        restored = m.load()
    assert restored is not None and restored.step == 2


def test_a_resting_engine_persisting_in_threads_leaves_no_thread_and_the_next_save_commits(tmp_path: Path) -> None:
    """The same for ``persist="thread"``: the heartbeat of the owner record stops too (it outlived a fit)."""
    before = set(threading.enumerate())
    with manager(tmp_path / "ckpt", persist="thread") as m:
        assert m.save(1, make_state(1)) is not None
        m.rest()
        assert [t.name for t in set(threading.enumerate()) - before] == []
        handle = m.save(2, make_state(2))
        assert handle is not None and handle.committed.result(60).step == 2
        assert "resilience-heartbeat" in [t.name for t in threading.enumerate()]  # the root is held again
    with manager(tmp_path / "ckpt") as m:
        restored = m.load()
    assert restored is not None and restored.step == 2


def test_a_resting_engine_holds_no_helper_or_thread_and_the_next_save_starts_one(tmp_path: Path) -> None:
    """What a Lightning teardown leaves: the engine drained, its helper process ended and no thread of the pack
    running; a save after it (``trainer.save_checkpoint`` after ``fit()``) gets a new helper and commits."""
    before = set(threading.enumerate())
    with manager(tmp_path / "ckpt", persist="process") as m:
        assert m.save(1, make_state(1)) is not None
        m.rest()
        first_pid = m.pipeline.pid  # type: ignore[union-attr]
        assert first_pid is not None
        assert [t.name for t in set(threading.enumerate()) - before] == []
        wait_for(lambda: process_start_ticks(first_pid) is None)  # the helper process ended too (or is a zombie)
        handle = m.save(2, make_state(2))
        assert handle is not None and handle.committed.result(60).step == 2
        assert m.pipeline.pid != first_pid  # type: ignore[union-attr]
        assert process_start_ticks(m.pipeline.pid) is not None  # type: ignore[union-attr]  # the new helper lives until close
    with manager(tmp_path / "ckpt") as m:
        restored = m.load()
    assert restored is not None and restored.step == 2
    assert torch.equal(restored.state["model"]["w"], make_state(2)["model"]["w"])  # type: ignore[index]


def test_a_forked_child_leaves_the_parents_engine_alone(tmp_path: Path) -> None:
    """A DataLoader worker is a forked child that runs threading's exit hooks when it ends: the engine's exit
    hook, inherited, closed the parent's helper from there (over the inherited connection), and the parent's
    next save then waited forever."""
    import multiprocessing

    with manager(tmp_path / "ckpt", persist="process") as m:
        first = m.save(1, make_state(1))
        assert first is not None and first.committed.result(60).step == 1
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.1,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        handle = m.save(2, make_state(2))
        assert handle is not None and handle.committed.result(60).step == 2


def test_a_dead_helper_stops_training_when_so_configured(tmp_path: Path) -> None:
    import signal

    with manager(tmp_path, on_helper_death="raise") as m:
        m.save(1, make_state(1))
        m.wait()
        os.kill(m.pipeline.pid, signal.SIGKILL)  # type: ignore[union-attr]
        wait_for(lambda: m.pipeline.died is not None)  # type: ignore[union-attr]
        with pytest.raises(CheckpointError, match=r"died.*on_helper_death='raise'"):
            m.save(2, make_state(2))


def test_a_save_committed_just_before_the_helper_died_stays_saved(tmp_path: Path) -> None:
    """The helper's commit message can arrive and its next one (the durable phase's end) not, when it dies in
    between (seen under load: the close then raised "Not saved" for a committed step)."""
    import signal

    from resilience.checkpoint.save_handle import SaveHandle

    with manager(tmp_path, on_helper_death="raise") as m:
        first = m.save(1, make_state(1))
        assert first is not None
        commit = first.committed.result(60)
        m.wait()
        between = SaveHandle(1)  # step 1's handle as it stands between the two messages
        between.committed.set_result(commit)
        m.pipeline._handles[1] = between  # type: ignore[attr-defined]
        os.kill(m.pipeline.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        wait_for(lambda: m.pipeline.died is not None)  # type: ignore[attr-defined]
        assert between.durable.result(5) is None  # no durable tier: nothing of it was lost
        assert m.pipeline.take_errors() == []
    with manager(tmp_path) as again:
        restored = again.load()
    assert restored is not None and restored.step == 1


def test_thousands_of_staged_tensors_need_no_file_descriptor_each(tmp_path: Path) -> None:
    """Every tensor gets a staging segment; with a descriptor held per segment, 600 of them broke the first save
    under a limit of 256 open files ("Too many open files")."""
    script = f"""
import resource, torch
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from resilience import CheckpointConfig, CheckpointManager
state = {{f"t{{i}}": torch.full((100,), float(i)) for i in range(600)}}
with CheckpointManager(CheckpointConfig({str(tmp_path)!r}, persist="process")) as m:
    m.save(1, state)
    m.wait()
    m.save(2, state)
    m.wait()
with CheckpointManager(CheckpointConfig({str(tmp_path)!r})) as m:
    restored = m.load()
assert restored.step == 2 and all(torch.equal(restored.state[k], v) for k, v in state.items())
print("OK", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], env=base_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, (done.stdout + done.stderr)[-4000:]


def test_a_process_that_staged_exits_without_a_leak_warning(tmp_path: Path) -> None:
    """Its segments and its lock go with a clean exit; Python's resource tracker found the lock and warned."""
    script = f"""
import torch
from resilience import CheckpointConfig, CheckpointManager
with CheckpointManager(CheckpointConfig({str(tmp_path)!r}, persist="process")) as m:
    m.save(1, {{"w": torch.ones(3_000_000)}})
    m.wait()
print("SAVED", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], env=base_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "SAVED" in done.stdout, done.stderr[-3000:]
    assert "leaked shared_memory" not in done.stderr, done.stderr[-3000:]


def test_a_process_killed_alone_leaves_no_segment_and_no_leak_warning(tmp_path: Path) -> None:
    """kill -9 of the training process alone (an in-place restart replaces a rank so): its resource tracker
    outlives it and unlinks every staging segment, without the warning that listed each of them as leaked."""
    script = f"""
import os, signal, torch
from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint.staging import SEGMENTS
m = CheckpointManager(CheckpointConfig({str(tmp_path)!r}, persist="process"))
m.save(1, {{f"t{{i}}": torch.ones(100) for i in range(50)}})
m.wait()
print(" ".join(SEGMENTS.values()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], env=base_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr[-3000:]
    left = done.stdout.split()
    assert len(left) == 50, done.stdout + done.stderr
    deadline = time.monotonic() + 30
    while any(os.path.exists(os.path.join(shm.SHM_DIR, name)) for name in left) and time.monotonic() < deadline:
        time.sleep(0.1)  # the tracker notices its pipe's end, then unlinks
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, name)) for name in left)
    assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr[-3000:]


def test_staging_memory_of_a_job_killed_as_a_process_group_is_reclaimed(tmp_path: Path) -> None:
    """kill -9 of a whole process group (training process, resource tracker, helpers) leaves its /dev/shm
    segments behind; the next process that stages removes them, and never a segment a live process holds."""
    script = f"""
import os, signal, torch
from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint.staging import SEGMENTS
os.setpgid(0, 0)
m = CheckpointManager(CheckpointConfig({str(tmp_path / "killed")!r}, persist="process"))
m.save(1, {{"w": torch.ones(1000), "b": torch.ones(3_000_000)}})
m.wait()
print(" ".join(SEGMENTS.values()), flush=True)
os.killpg(0, signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], env=base_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == -9
    left = done.stdout.split()
    assert len(left) == 2 and all(name.startswith(shm.PREFIX) for name in left), done.stdout + done.stderr
    assert all(os.path.exists(os.path.join(shm.SHM_DIR, name)) for name in left), "the group kill left nothing"
    with manager(tmp_path / "alive", persist="process") as m:  # a live manager's segments are locked
        m.save(1, {"b": torch.ones(3_000_000)})
        m.wait()
        live = list(SEGMENTS.values())
        time.sleep(1.1)  # older than the sweep's minimum age below: segments younger may not be locked yet
        assert shm.reclaim_orphans(min_age_s=1.0) >= 12_000_000
        assert not any(os.path.exists(os.path.join(shm.SHM_DIR, name)) for name in left)
        assert live and all(os.path.exists(os.path.join(shm.SHM_DIR, name)) for name in live)
        m.save(2, {"b": torch.full((3_000_000,), 2.0)})  # the helper still maps the live buffers by name
        m.wait()
        restored = m.load(step=2)
    assert restored is not None and torch.equal(restored.state["b"], torch.full((3_000_000,), 2.0))


def test_a_durable_shard_flipped_in_place_is_never_loaded(tmp_path: Path) -> None:
    """verify="auto" checks durable shards by size before a load and hashes each as it is read: a bit flipped in a
    durable shard (same size) fails that read, the copy is set aside, and the older step loads instead."""
    durable = (tmp_path / "durable").as_uri()
    with CheckpointManager(CheckpointConfig(tmp_path / "node-a", durable_url=durable, keep_last=3)) as m:
        for step in (1, 2):
            m.save(step, make_state(step))
            assert m.wait(durable=True)
    shard = tmp_path / "durable" / "step-2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with CheckpointManager(CheckpointConfig(tmp_path / "fresh-node", durable_url=durable)) as m:
        restored = m.load()
    assert restored is not None and restored.step == 1 and restored.tier == "durable"
    assert torch.equal(restored.state["model"]["w"], make_state(1)["model"]["w"])
    assert list((tmp_path / "durable" / "step-2").glob("manifest.json.corrupt-*")), "the corrupt copy stays found"
