"""The durable tier against a real S3-protocol server (moto) on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from resilience import CheckpointConfig, CheckpointError, CheckpointManager, ConfigError
from resilience.storage.tiers import DurableTier
from tests.helpers import S3_ENV, MotoServer
from tests.test_engine_local import make_state

FAST_FAIL = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 2}}


def manager(root: Path, s3: dict[str, object], **kw: object) -> CheckpointManager:
    kw.setdefault("keep_last", 2)
    return CheckpointManager(
        CheckpointConfig(root, durable_url=str(s3["url"]), storage_options=s3["options"], **kw)  # type: ignore[arg-type]
    )


def test_upload_commits_remotely_and_a_fresh_node_resumes_from_the_url(tmp_path: Path, s3: dict[str, object]) -> None:
    fs = s3["fs"]
    events: list[dict[str, object]] = []
    with manager(tmp_path / "node-a", s3) as m:
        m.add_listener(events.append)
        for step in (1, 2, 3):
            m.save(step, make_state(step))
            assert m.wait(durable=True)
    listed = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpt-bucket/run"))  # type: ignore[attr-defined]
    assert listed == [".lease", "step-2", "step-3"], listed  # retention ran in the durable tier too
    remote = json.loads(fs.cat_file("ckpt-bucket/run/step-3/manifest.json"))  # type: ignore[attr-defined]
    assert remote["timings"]["upload_s"] >= 0 and remote["step"] == 3
    assert "testing" not in json.dumps(remote), "credentials must never reach a manifest"
    assert any(e["event"] == "durable_commit" and e["step"] == 3 for e in events)

    with manager(tmp_path / "node-b", s3) as m:  # empty local disk: the newest commit is remote
        restored = m.load()
    assert restored is not None and restored.step == 3 and restored.tier == "durable"
    assert torch.equal(restored.state["model"]["w"], make_state(3)["model"]["w"])


def test_an_exclusive_write_refuses_a_key_that_exists(s3: dict[str, object]) -> None:
    """A manifest PUT carries If-None-Match: * (botocore from 1.35.21; s3fs's pipe_file(mode="create")), and
    the server refuses it where the key exists (moto from 5.0.15): a committed manifest is never replaced."""
    tier = DurableTier(str(s3["url"]), s3["options"])  # type: ignore[arg-type]
    path = f"{tier.root}/step-1/manifest.json"
    tier.write_exclusive(path, b"first")
    with pytest.raises(FileExistsError):
        tier.write_exclusive(path, b"second")
    assert tier.read_bytes(path) == b"first"


def saved(root: Path, s3: dict[str, object], steps: list[int]) -> str:
    """A run that saved ``steps``, each committed in both tiers; its run id."""
    with manager(root, s3, keep_last=3) as m:
        for step in steps:
            m.save(step, make_state(step))
            assert m.wait(durable=True)
        assert m.run_id is not None
        return m.run_id


def hold_uploads(monkeypatch: pytest.MonkeyPatch, match: str) -> threading.Event:
    """Hold every upload of a file whose path contains ``match`` (in this process) until the event is set."""
    gate = threading.Event()
    original = DurableTier.put_file

    def held(self: DurableTier, local_path: str, path: str, callback: object = None) -> None:
        if match in path:
            gate.wait(120)
        original(self, local_path, path, callback)  # type: ignore[arg-type]

    monkeypatch.setattr(DurableTier, "put_file", held)
    return gate


def test_a_slow_upload_is_not_queued_behind_newer_checkpoints(
    tmp_path: Path, s3: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = hold_uploads(monkeypatch, "step-1/")
    events: list[dict[str, object]] = []
    with manager(tmp_path, s3, keep_last=3) as m:
        m.add_listener(events.append)
        first = m.save(1, make_state(1))
        second = m.save(2, make_state(2))
        third = m.save(3, make_state(3))
        assert first and second and third and third.committed.result(30)
        gate.set()
        assert third.durable.result(60) and first.durable.result(60)
        assert second.durable.result(60) is None, "step 2 was superseded by step 3 while step 1 uploaded"
    fs = s3["fs"]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("ckpt-bucket/run")) == [".lease", "step-1", "step-3"]  # type: ignore[attr-defined]
    assert any(e["event"] == "upload_skipped" and e["step"] == 2 for e in events)


def test_local_copy_is_preferred_and_a_corrupt_remote_falls_back(tmp_path: Path, s3: dict[str, object]) -> None:
    fs = s3["fs"]
    with manager(tmp_path / "a", s3) as m:
        for step in (1, 2):
            m.save(step, make_state(step))
        m.wait(durable=True)
    with manager(tmp_path / "a", s3) as m:
        restored = m.load()
        assert restored is not None and restored.tier == "local" and restored.step == 2
    shutil.rmtree(tmp_path / "a")
    shard = next(p for p in fs.ls("ckpt-bucket/run/step-2") if p.endswith(".distcp"))  # type: ignore[attr-defined]
    fs.pipe_file(shard, b"truncated")  # type: ignore[attr-defined]
    with (
        manager(tmp_path / "b", s3) as m,
        pytest.warns(UserWarning, match="Skipping step 2 in the durable tier"),
    ):
        restored = m.load()
    assert restored is not None and restored.step == 1 and restored.tier == "durable"
    names = [p.rsplit("/", 1)[-1] for p in fs.ls("ckpt-bucket/run/step-2")]  # type: ignore[attr-defined]
    assert "manifest.json" not in names and any(n.startswith("manifest.json.corrupt-") for n in names)


def test_missing_credentials_fail_at_start_with_the_fix(
    tmp_path: Path, s3: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ConfigError, match="provide credentials"):
        manager(tmp_path, s3)
    assert not list(tmp_path.glob("step-*"))


@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_server_killed_mid_upload_keeps_the_local_commit(
    tmp_path: Path, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    server = MotoServer().start()
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        options = {"endpoint_url": server.endpoint, **FAST_FAIL}
        s3fs.S3FileSystem(**options).mkdir("dying-bucket")
        s3 = {"url": "s3://dying-bucket/run", "options": options}
        m = manager(tmp_path, s3, upload_retries=1, upload_backoff_s=0.01, on_upload_error=policy)
        m.save(1, make_state(1))
        m.wait(durable=True)
        server.stop()  # the object store goes away
        handle = m.save(2, make_state(2))
        assert handle is not None and handle.committed.result(60)
        with pytest.raises(CheckpointError, match=r"Uploading the checkpoint failed.*gave up.*step=2, tier=durable"):
            handle.durable.result(120)
        if policy == "raise":  # training stops at its next save, with the upload's error
            with pytest.raises(CheckpointError, match="Uploading the checkpoint failed"):
                m.save(3, make_state(3))
            m.abandon()  # as the job's end would: nothing of it (its heartbeat) outlives the test
        else:  # training goes on, checkpointing to the local tier
            third = m.save(3, make_state(3))
            assert third is not None and third.committed.result(60)
            m.close()
    finally:
        server.stop()
    assert (tmp_path / "step-2" / "manifest.json").exists(), "the local commit must stay"


def test_cli_upload_commits_what_the_durable_tier_lacks(
    tmp_path: Path, s3: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    from resilience.cli import main as cli

    with CheckpointManager(CheckpointConfig(tmp_path / "local", keep_last=3)) as m:  # no durable tier yet
        for step in (1, 2):
            m.save(step, make_state(step))
    endpoint = f"endpoint_url={s3['options']['endpoint_url']}"  # type: ignore[index]
    assert cli(["upload", str(tmp_path / "local"), str(s3["url"]), "--storage-option", endpoint, "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "OK   step 1 committed" in out and "OK   step 2 committed" in out and "100.0%" in err
    assert cli(["upload", str(tmp_path / "local"), str(s3["url"]), "--storage-option", endpoint]) == 0
    assert "nothing to upload" in capsys.readouterr().out
    with manager(tmp_path / "fresh-node", s3) as m:
        restored = m.load()
    assert restored is not None and restored.tier == "durable" and restored.step == 2
    assert torch.equal(restored.state["model"]["w"], make_state(2)["model"]["w"])
    with CheckpointManager(CheckpointConfig(tmp_path / "local", keep_last=3)) as m:
        m.load()
        m.save(3, make_state(3))
    shard = next((tmp_path / "local" / "step-3").glob("__*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli(["upload", str(tmp_path / "local"), str(s3["url"]), "--storage-option", endpoint]) == 4
    assert "checksum" in capsys.readouterr().err
    assert not s3["fs"].exists("ckpt-bucket/run/step-3/manifest.json")  # type: ignore[attr-defined]


def test_a_mistyped_bucket_is_refused_at_set_up_and_never_created(tmp_path: Path, s3: dict[str, object]) -> None:
    fs = s3["fs"]
    typo = {**s3, "url": "s3://ckpt-bukket/run"}
    with pytest.raises(ConfigError, match=r"bucket 'ckpt-bukket' does not exist.*never creates one"):
        manager(tmp_path, typo)
    assert not fs.exists("ckpt-bukket")  # type: ignore[attr-defined]
    wrong_endpoint = {**s3, "options": {"endpoint_url": "http://127.0.0.1:9", **FAST_FAIL}}
    with pytest.raises(ConfigError, match=r"not reachable.*check the endpoint"):
        manager(tmp_path, wrong_endpoint)
