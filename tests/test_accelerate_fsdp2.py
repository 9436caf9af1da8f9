"""Accelerate's FSDP2 (``fsdp_version=2``) through ``attach()``: asynchronous interval saves of the DTensor shards,
``kill -9`` of the whole job and a relaunch that resumes bit-exact, and resharding between 2 ranks and 1.

The closest launch Accelerate supports on CPU: ``accelerate launch --multi_gpu --num_processes 2`` with
``Accelerator(cpu=True)`` (gloo), and ``torchrun --nproc_per_node 1`` for one rank (``accelerate launch`` refuses
``--multi_gpu`` with one process, and without it starts no process group, which FSDP2's mesh needs). Accelerate
1.15 keeps FSDP off for CPU processes, so the worker switches its state to FSDP after making the Accelerator
(tests/workers/accelerate_train.py says how); ``prepare()`` then runs Accelerate's own FSDP2 code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience.checkpoint.safe_reads import load_dcp_metadata
from resilience.storage import catalog
from resilience.storage.tiers import LocalTier
from tests.helpers import free_port
from tests.test_accelerate_launch import (
    LAUNCH_TIMEOUT_S,
    WORKER,
    assert_same_training,
    committed_steps,
    job_env,
    kill_once_committed,
    run_job,
)

pytestmark = pytest.mark.timeout(900)
STOP_AT = 7


def fsdp2_env(tmp: Path, **settings: str) -> dict[str, str]:
    return job_env(tmp, TRAIN_FSDP2="1", ACCELERATE_RESILIENCE_LOCAL_ROOT=str(tmp / "ckpt"), **settings)


def run_one_rank(out: Path, env: dict[str, str]) -> dict[str, Any]:
    """One rank through torchrun (what ``accelerate launch --multi_gpu`` runs); its final state."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port"]
    command += [str(free_port()), str(WORKER), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return load(out / "final-rank0.pt")


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Parameters, optimizer moments and steps (by parameter name), and the scheduler, exactly."""
    assert got["model"].keys() == want["model"].keys()
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), f"parameter {name} differs"
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for param, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["optimizer"]["state"][param][name], value), (param, name)
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["scheduler"] == want["scheduler"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """One uninterrupted FSDP2 run of all epochs on 2 ranks."""
    tmp = tmp_path_factory.mktemp("fsdp2-reference")
    return run_job(tmp / "out", fsdp2_env(tmp))


def test_fsdp2_kill_9_mid_run_then_relaunch_resumes_bit_exact(
    tmp_path: Path, reference: dict[int, dict[str, Any]]
) -> None:
    settings = {"ACCELERATE_RESILIENCE_EVERY_N_STEPS": "2"}  # asynchronous saves (async staging is the default)
    newest = kill_once_committed(tmp_path / "killed", fsdp2_env(tmp_path, **settings, TRAIN_STEP_SLEEP="0.2"), 6)
    manifest = json.loads((tmp_path / "ckpt" / f"step-{newest}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {f["rank"] for f in manifest["files"] if f["kind"] == "shard"} == {0, 1}
    entry = next(e for e in catalog.scan(LocalTier(tmp_path / "ckpt")) if e.step == newest)
    weight = load_dcp_metadata(entry).state_dict_metadata["training/models/0/0.weight"]
    assert len(weight.chunks) == 2, "saved as the two ranks' FSDP2 shards"  # type: ignore[union-attr]

    got = run_job(tmp_path / "resumed", fsdp2_env(tmp_path, **settings))
    assert got[0]["resume"]["global_step"] == newest and got[0]["resume"]["restored"]
    assert_same_training(got, reference)


@pytest.mark.parametrize(
    ("saved_on", "resumed_on"), [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)], ids=["2-to-1", "1-to-2"]
)
def test_fsdp2_checkpoint_reshards_between_2_and_1_ranks(tmp_path: Path, saved_on: int, resumed_on: int) -> None:
    """Saved with ``accelerator.save_state()`` at step 7 on one rank count, resumed with one call on the other:
    the restored shards, gathered, equal the saved state exactly; training then runs to the end."""

    def launch(out: Path, world: int, **settings: str) -> dict[str, Any]:
        env = fsdp2_env(tmp_path, **settings)
        return run_job(out, env)[0] if world == 2 else run_one_rank(out, env)

    saved = launch(tmp_path / "saved", saved_on, TRAIN_STOP_AT=str(STOP_AT))
    assert committed_steps(tmp_path / "ckpt") == [STOP_AT]
    resumed = launch(tmp_path / "resumed", resumed_on)
    assert resumed["resume"]["global_step"] == STOP_AT and resumed["resume"]["restored"]
    assert_same_state(load(tmp_path / "resumed" / "restored-rank0.pt"), saved)
