"""The engine in real 2-process gloo jobs: parallel per-rank writes, resharding, agreement, failures, S3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilience.storage.manifest import Manifest
from tests.helpers import WORKERS, check_ranks, reseal, run_ranks

WORKER = WORKERS / "engine_worker.py"


def run(scenario: str, root: Path, world: int, env: dict[str, str] | None = None, durable: str = "-") -> list[str]:
    results = check_ranks(run_ranks(WORKER, [scenario, str(root), durable], world, env=env, timeout=180))
    return [r.output for r in results]


def manifest(root: Path, step: int) -> Manifest:
    path = root / f"step-{step}" / "manifest.json"
    return Manifest.from_json(path.read_bytes(), where=str(path), expected_step=step)


def test_two_ranks_write_in_parallel_and_reload_on_two_and_one(tmp_path: Path) -> None:
    run("save", tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-2", "step-3"]  # keep_last=2
    committed = manifest(tmp_path, 3)
    assert committed.world_size == 2
    shard_ranks = {f.rank for f in committed.files if f.kind == "shard"}
    assert shard_ranks == {0, 1}, "both ranks must write shards"
    assert {f.path for f in committed.files if f.kind == "state"} == {
        "state.json",
        "rank-0.json",
        "rank-1.json",
    }
    outputs = run("load", tmp_path, 2, env={"TEST_EXPECT_STEP": "3"})
    assert all("LOADED 3 local 2" in out for out in outputs)
    outputs = run("load", tmp_path, 1, env={"TEST_EXPECT_STEP": "3"})  # resharding 2 -> 1
    assert "LOADED 3 local 2" in outputs[0]


@pytest.mark.slow  # 1 -> 2 ranks is also run by test_reliability_reshard (DDP and FSDP2)
def test_reshard_one_to_two(tmp_path: Path) -> None:
    run("save", tmp_path, 1, env={"TEST_STEPS": "4"})
    assert manifest(tmp_path, 4).world_size == 1
    outputs = run("load", tmp_path, 2, env={"TEST_EXPECT_STEP": "4"})
    assert all("LOADED 4 local 1" in out for out in outputs)


def test_helpers_rested_on_two_ranks_start_again_at_the_next_save(tmp_path: Path) -> None:
    """Rank 0 hosts the helpers' store once; every rank's next helper group meets there again (before, the ranks
    without the store tried to set one up again, a collective rank 0 never joined)."""
    outputs = run("rest", tmp_path, 2)
    assert all("RESTED 2" in out for out in outputs)
    outputs = run("load", tmp_path, 2, env={"TEST_EXPECT_STEP": "2"})
    assert all("LOADED 2 local 2" in out for out in outputs)


def test_skip_decision_is_the_same_on_every_rank(tmp_path: Path) -> None:
    outputs = run("busy", tmp_path, 2)
    assert all("BUSY 1" in out for out in outputs)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-2", "step-4"]  # keep_last=2; step 3 skipped


@pytest.mark.parametrize("persist", ["thread", "process"])
def test_a_name_on_two_ranks_takes_rank_0s_share_from_memory_and_the_rest_from_the_shards(
    tmp_path: Path, persist: str
) -> None:
    outputs = run("name", tmp_path / "ckpt", 2, env={"TEST_PERSIST": persist})
    assert "NAMED" in outputs[0]


def test_failure_on_one_rank_raises_on_all_and_commits_nothing(tmp_path: Path) -> None:
    outputs = run("fail", tmp_path, 2)
    for out in outputs:
        assert "RAISED" in out and "No space left on device" in out and "step=1" in out
    assert not (tmp_path / "step-1" / "manifest.json").exists()


def test_a_bad_state_file_of_one_rank_makes_every_rank_fall_back_together(tmp_path: Path) -> None:
    """Rank 1's own state file is malformed (its checksum resealed, so only parsing finds it): no rank may be
    left waiting in the read, the copy is set aside, and every rank loads the older checkpoint."""
    run("save", tmp_path, 2, env={"TEST_STEPS": "1,2"})
    step_dir = tmp_path / "step-2"
    (step_dir / "rank-1.json").write_text('{"rank": {"$t": "no-such-tag"}}')
    reseal(step_dir, "rank-1.json")
    outputs = run("load", tmp_path, 2, env={"TEST_EXPECT_STEP": "1"})
    assert all("LOADED 1" in out for out in outputs)
    assert "no-such-tag" in outputs[0] and "Skipping step 2" in outputs[0]
    assert not step_dir.exists() and [p.name.split("-")[1] for p in (tmp_path / "quarantine").iterdir()] == ["2"]


@pytest.mark.slow  # S3 from 2 ranks: also the two-node tests (durable tier) and test_engine_s3
def test_two_ranks_upload_to_s3_and_reload_from_the_url(tmp_path: Path, s3: dict[str, object]) -> None:
    env = {"TEST_STORAGE_OPTIONS": json.dumps(s3["options"]), "TEST_STEPS": "1,2"}
    run("save", tmp_path / "a", 2, env=env, durable=str(s3["url"]))
    fs = s3["fs"]
    remote = json.loads(fs.cat_file("ckpt-bucket/run/step-2/manifest.json"))  # type: ignore[attr-defined]
    assert remote["world_size"] == 2 and {f["rank"] for f in remote["files"]} == {0, 1}
    for entry in remote["files"]:
        assert fs.size(f"ckpt-bucket/run/step-2/{entry['path']}") == entry["size"]  # type: ignore[attr-defined]
    # a new node with an empty local disk resumes straight from the durable URL, on 1 rank
    outputs = run("load", tmp_path / "b", 1, env={**env, "TEST_EXPECT_STEP": "2"}, durable=str(s3["url"]))
    assert "LOADED 2 durable 2" in outputs[0]
