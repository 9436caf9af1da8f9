"""Two CPU ranks through ``accelerate launch --multi_gpu --num_processes 2``, as users launch them.

Stop and resume, kill -9 of the whole job and resume, resume from S3 (moto on loopback) on an empty local
disk, and a preemption signal that all ranks save for before an elastic restart: every resumed run must end
bit-identical (parameters, optimizer, scheduler, the samples each rank trained on) to one uninterrupted run,
across an epoch boundary.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience.goodput import summarize
from tests.helpers import S3_ENV, WORKERS, MotoServer, accelerate_launch, base_env, kill_job

WORKER = WORKERS / "accelerate_train.py"
LAUNCH_TIMEOUT_S = 240
STOP_AT = 7  # 5 steps per epoch on 2 ranks: epoch 1, batch 2 — after an epoch boundary, before the next
FINAL_STEP = 15

pytestmark = pytest.mark.timeout(900)


def job_env(tmp: Path, **settings: str) -> dict[str, str]:
    """No ACCELERATE_* from the caller's shell and no user config file (HF_HOME is fresh) leak into the job."""
    env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    env["HF_HOME"] = str(tmp / "hf-home")
    env.update(settings)
    return env


def start(out: Path, env: dict[str, str], *flags: str) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    command = accelerate_launch(WORKER, str(out), flags=flags)
    with (out / "launch.log").open("w") as log:
        return subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )


@contextlib.contextmanager
def running(out: Path, env: dict[str, str], *flags: str) -> Iterator[subprocess.Popen[str]]:
    proc = start(out, env, *flags)
    try:
        yield proc
    finally:
        kill_job(proc)


def run_job(out: Path, env: dict[str, str], *flags: str) -> dict[int, dict[str, Any]]:
    """Launch, wait, and return each rank's final state; fail with the job's output if it did not finish."""
    with running(out, env, *flags) as proc:
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not finish in {LAUNCH_TIMEOUT_S}s:\n{(out / 'launch.log').read_text()[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"the job exited {proc.returncode}:\n{(out / 'launch.log').read_text()[-6000:]}")
    return {rank: torch.load(out / f"final-rank{rank}.pt", weights_only=False) for rank in (0, 1)}


def kill_once_committed(out: Path, env: dict[str, str], step: int) -> int:
    """Launch, SIGKILL the whole job once a checkpoint of ``step`` or later is committed; the newest step then."""
    root = Path(env["ACCELERATE_RESILIENCE_LOCAL_ROOT"])
    with running(out, env) as proc:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not any(saved >= step for saved in committed_steps(root)):
            assert proc.poll() is None, f"the job ended early:\n{(out / 'launch.log').read_text()}"
            assert time.monotonic() < deadline, f"no checkpoint of step >= {step} was committed in time"
            time.sleep(0.05)
        kill_job(proc)
    newest = committed_steps(root)[-1]
    assert newest < FINAL_STEP, "the job was not killed mid-run"
    return newest


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in root.glob("step-*/manifest.json"))


def assert_same_training(got: dict[int, dict[str, Any]], want: dict[int, dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert got[rank]["indices"] == want[rank]["indices"], f"rank {rank} trained on other samples"
        for name, tensor in want[rank]["model"].items():
            assert torch.equal(got[rank]["model"][name], tensor), f"rank {rank}: parameter {name} differs"
        for index, state in want[rank]["optimizer"]["state"].items():
            for name, value in state.items():
                assert torch.equal(got[rank]["optimizer"]["state"][index][name], value), (rank, index, name)
        assert got[rank]["scheduler"] == want[rank]["scheduler"]
    assert got[0]["indices"] != got[1]["indices"], "each rank keeps its own registered-object state"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """One uninterrupted run of all epochs."""
    tmp = tmp_path_factory.mktemp("reference")
    return run_job(tmp / "out", job_env(tmp, ACCELERATE_RESILIENCE_LOCAL_ROOT=str(tmp / "ckpt")))


@pytest.fixture(scope="module")
def bucket(moto_server: MotoServer) -> dict[str, Any]:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(endpoint_url=moto_server.endpoint)
    fs.mkdir("accelerate-bucket")
    return {"url": "s3://accelerate-bucket/run", "options": {"endpoint_url": moto_server.endpoint}, "fs": fs}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory, bucket: dict[str, Any]) -> dict[str, Any]:
    """A run that saves with accelerator.save_state() at step 7 and stops; local disk plus S3."""
    tmp = tmp_path_factory.mktemp("stopped")
    settings = {
        **S3_ENV,
        "ACCELERATE_RESILIENCE_LOCAL_ROOT": str(tmp / "ckpt"),
        "ACCELERATE_RESILIENCE_DURABLE_URL": bucket["url"],
        "ACCELERATE_RESILIENCE_STORAGE_OPTIONS": json.dumps(bucket["options"]),
        "TRAIN_STOP_AT": str(STOP_AT),
    }
    run_job(tmp / "out", job_env(tmp, **settings))
    return {"tmp": tmp, "settings": settings}


def test_stop_then_resume_is_bit_exact(stopped: dict[str, Any], reference: dict[int, dict[str, Any]]) -> None:
    tmp: Path = stopped["tmp"]
    assert committed_steps(tmp / "ckpt") == [STOP_AT]
    metrics = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("checkpoint/committed_step") == STOP_AT and "checkpoint/write_s" in m for m in metrics)

    settings = {k: v for k, v in stopped["settings"].items() if k != "TRAIN_STOP_AT"}
    got = run_job(tmp / "resumed", job_env(tmp, **settings))
    point = got[0]["resume"]
    assert (point["epoch"], point["batch_in_epoch"], point["global_step"], point["batches_to_skip"]) == (1, 2, 7, 0)
    assert point["path"] == str(tmp / "ckpt" / f"step-{STOP_AT}")
    assert_same_training(got, reference)
    assert committed_steps(tmp / "ckpt") == [STOP_AT]  # nothing more was saved: no interval, no stop step


@pytest.mark.slow  # an empty disk resuming from the durable tier: also test_engine_s3 and the two-node tests
def test_resume_from_s3_on_an_empty_local_disk(
    stopped: dict[str, Any], reference: dict[int, dict[str, Any]], bucket: dict[str, Any]
) -> None:
    assert bucket["fs"].exists(f"{bucket['url']}/step-{STOP_AT}/manifest.json")
    tmp: Path = stopped["tmp"]
    settings = {k: v for k, v in stopped["settings"].items() if k != "TRAIN_STOP_AT"}
    settings["ACCELERATE_RESILIENCE_LOCAL_ROOT"] = str(tmp / "empty-local")
    got = run_job(tmp / "from-s3", job_env(tmp, **settings))
    point = got[1]["resume"]
    assert (point["epoch"], point["batch_in_epoch"], point["global_step"]) == (1, 2, STOP_AT)
    assert point["path"] == f"{bucket['url']}/step-{STOP_AT}"
    assert_same_training(got, reference)


@pytest.mark.slow  # kill -9 and relaunch under accelerate launch: also the FSDP2 and rank-kill tests
def test_kill_9_mid_run_then_relaunch_resumes_from_newest_commit(
    tmp_path: Path, reference: dict[int, dict[str, Any]]
) -> None:
    # A plain DataLoader this time: the resumed epoch is skipped into with accelerator.skip_first_batches.
    settings = {
        "ACCELERATE_RESILIENCE_LOCAL_ROOT": str(tmp_path / "ckpt"),
        "ACCELERATE_RESILIENCE_EVERY_N_STEPS": "2",
        "TRAIN_STATEFUL": "0",
    }
    newest = kill_once_committed(tmp_path / "killed", job_env(tmp_path, **settings, TRAIN_STEP_SLEEP="0.2"), 6)

    got = run_job(tmp_path / "resumed", job_env(tmp_path, **settings))
    point = got[0]["resume"]
    assert point["global_step"] == newest and point["restored"]
    assert point["epoch"] * 5 + point["batch_in_epoch"] == newest
    assert point["batches_to_skip"] == point["batch_in_epoch"]
    assert_same_training(got, reference)


def test_a_rank_killed_mid_step_is_saved_around_by_the_other_and_the_relaunch_is_exact(
    tmp_path: Path, reference: dict[int, dict[str, Any]]
) -> None:
    """kill -9 of rank 1 at the start of step 8 under ``accelerate launch``: rank 0's gradient all-reduce fails, its
    survivor save commits step 7 (interval saves were every 4), it exits 75, and the relaunch is bit-exact."""
    settings = {"ACCELERATE_RESILIENCE_LOCAL_ROOT": str(tmp_path / "ckpt"), "ACCELERATE_RESILIENCE_EVERY_N_STEPS": "4"}
    with running(tmp_path / "killed", job_env(tmp_path, **settings, TRAIN_VICTIM="1:7")) as proc:
        proc.wait(timeout=LAUNCH_TIMEOUT_S)
    log = (tmp_path / "killed" / "launch.log").read_text()
    assert "survivor save of step 7 by ranks [0] (lost: [1]): committed" in log, log[-6000:]
    assert committed_steps(tmp_path / "ckpt")[-1] == 7
    manifest = json.loads((tmp_path / "ckpt" / "step-7" / "manifest.json").read_text())
    assert manifest["extra"]["survivor_save"] == {"saved_by": [0], "lost": [1]}
    got = run_job(tmp_path / "resumed", job_env(tmp_path, **settings))
    assert got[0]["resume"]["global_step"] == 7 and got[1]["resume"]["global_step"] == 7
    assert_same_training(got, reference)


def test_preemption_saves_on_every_rank_and_an_elastic_restart_resumes(
    tmp_path: Path, reference: dict[int, dict[str, Any]]
) -> None:
    settings = {
        "ACCELERATE_RESILIENCE_LOCAL_ROOT": str(tmp_path / "ckpt"),
        "ACCELERATE_RESILIENCE_HEALTH": "1",
        "TRAIN_PREEMPT_AT": "9",  # SIGTERM to rank 1 in the first attempt; no save is due at step 9 otherwise
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # restarts on torch 2.13 are flaky without it
    }
    got = run_job(tmp_path / "out", job_env(tmp_path, **settings), "--max_restarts", "1", "--rdzv_backend", "c10d")
    log = (tmp_path / "out" / "launch.log").read_text()
    assert log.count("RESUME rank=0") == 2 and log.count("RESUME rank=1") == 2, log[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: emergency save of step 9 committed locally" in log, log[-4000:]
    assert "exitcode  : 75" in log or "exitcode: 75" in log, log[-4000:]
    # with no logging set up by the script, the resume is still said, once (the main process), with its time
    assert log.count("resilience: Restored step 9 from the local tier") == 1, log[-4000:]
    point = got[0]["resume"]
    assert (point["epoch"], point["batch_in_epoch"], point["global_step"]) == (1, 4, 9)
    assert_same_training(got, reference)
    # The goodput ledger (rank 0): the stop as a failure with its fault and emergency save, nothing redone.
    summary = summarize(tmp_path / "ckpt")
    stopped, restarted = summary.incarnations
    assert summary.failures == 1 and (stopped.end_reason or "").startswith("stopped, exit code 75: ")
    markers = [(event["e"], event["reason"]) for event in stopped.events if event["e"] in ("fault", "emergency")]
    assert markers[0][0] == "fault" and markers[1] == ("emergency", "emergency save of step 9"), markers
    assert markers[2:] == [("emergency", "the stop's last writes and uploads")], markers
    assert stopped.last_step == 9 and stopped.buckets["emergency"] > 0
    assert (restarted.restored_step, restarted.redone_steps, restarted.restart_count) == (9, 0, 1)
    assert restarted.end_reason == "completed" and summary.buckets["lost"] == 0
