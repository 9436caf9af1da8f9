"""Proofs: a resume on the node that committed a checkpoint skips re-hashing shards nothing has touched since,
and still hashes (and so catches) any that something wrote, replaced or renamed, or that the proof cannot vouch
for."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.storage import catalog, dcp_fs, proofs
from resilience.storage.layout import proof_file
from resilience.storage.manifest import FileEntry


def files(directory: Path, names: list[str]) -> list[tuple[str, str]]:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(name.encode() * 1000)
    return [(name, "shard") for name in names]


def test_a_file_untouched_since_it_was_hashed_is_proven_and_any_change_undoes_that(tmp_path: Path) -> None:
    names = files(tmp_path, ["a", "b", "c", "d"])
    time.sleep(0.1)  # older than a clock tick when hashed: not "racily clean"
    entries = {e.path: e for e in proofs.hashed(str(tmp_path), 0, names)}
    assert (tmp_path / proof_file(0)).exists()
    found = proofs.Proofs(str(tmp_path))
    assert all(found.holds(e) for e in entries.values())
    os.utime(tmp_path / "a")  # only the times
    (tmp_path / "b").write_bytes((tmp_path / "b").read_bytes())  # the same bytes written again
    shutil.copy(tmp_path / "c", tmp_path / "c.new")
    os.replace(tmp_path / "c.new", tmp_path / "c")  # replaced by an identical file
    assert [name for name, e in entries.items() if found.holds(e)] == ["d"]


def test_a_file_hashed_right_after_it_was_written_is_proven(tmp_path: Path) -> None:
    """A commit records its proof within a clock tick of its last write: the recorder waits the tick out, or the
    proof of the shards just written would never hold and every resume would hash them again."""
    names = files(tmp_path, ["a", "b"])
    entries = proofs.hashed(str(tmp_path), 0, names)
    assert all(proofs.Proofs(str(tmp_path)).holds(e) for e in entries)


def test_a_file_changed_within_a_tick_of_its_proof_is_hashed_again(tmp_path: Path) -> None:
    names = files(tmp_path, ["a"])
    (entry,) = proofs.hashed(str(tmp_path), 0, names)
    proof = tmp_path / proof_file(0)
    body = json.loads(proof.read_text())
    body["recorded_ns"] = os.stat(tmp_path / "a").st_ctime_ns + proofs.RACY_NS // 2  # as if recorded at once
    proof.write_text(json.dumps(body))
    assert not proofs.Proofs(str(tmp_path)).holds(entry)


def test_a_file_changed_while_its_proof_waits_out_the_tick_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = files(tmp_path, ["a", "b"])
    waits: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        (tmp_path / "a").write_bytes(b"A" * 1000)  # the same size, other bytes, written meanwhile
        real_sleep(seconds)

    monkeypatch.setattr(proofs.time, "sleep", sleep)
    entries = {e.path: e for e in proofs.hashed(str(tmp_path), 0, names)}
    assert waits and max(waits) <= (proofs.RACY_NS + 1_000_000) / 1e9
    found = proofs.Proofs(str(tmp_path))
    assert not found.holds(entries["a"]) and found.holds(entries["b"])


def test_only_the_writing_ranks_proof_vouches_for_a_file(tmp_path: Path) -> None:
    names = files(tmp_path, ["a"])
    time.sleep(0.1)
    (entry,) = proofs.hashed(str(tmp_path), 1, names)
    assert proofs.Proofs(str(tmp_path)).holds(entry)
    assert not proofs.Proofs(str(tmp_path)).holds(FileEntry("a", entry.size, entry.xxh3_64, 0, "shard"))


@pytest.mark.parametrize(
    "tamper",
    [
        lambda body: body.replace(b'"xxh3_64": "', b'"xxh3_64": "0'),  # another checksum than the manifest's
        lambda body: body[: len(body) // 2],  # torn
        lambda body: body.replace(b'"version": 1', b'"version": 9'),
        lambda body: body.replace(b'"size": 1000', b'"size": "1000"'),
        lambda body: b"[]",
    ],
)
def test_a_malformed_or_mismatched_proof_vouches_for_nothing(tmp_path: Path, tamper: Any) -> None:
    names = files(tmp_path, ["a"])
    time.sleep(0.1)
    (entry,) = proofs.hashed(str(tmp_path), 0, names)
    proof = tmp_path / proof_file(0)
    proof.write_bytes(tamper(proof.read_bytes()))
    assert not proofs.Proofs(str(tmp_path)).holds(entry)
    assert not proofs.Proofs(str(tmp_path)).holds(FileEntry("a", entry.size, "0" * 16, 0, "shard"))


# ---- through the engine ---------------------------------------------------------------------------------------


def make_state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=gen), "v": torch.randn(1024, 300, generator=gen), "step": step}


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    calls: list[Any] = []
    real = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


def shards(root: Path, step: int) -> list[Path]:
    return sorted((root / f"step-{step}").glob("*.distcp"))


def test_a_resume_on_the_committing_node_hashes_no_untouched_shard_and_still_catches_a_written_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path, keep_last=3)) as m:
        for step in (1, 2):
            m.save(step, make_state(step))
    assert shards(tmp_path, 2) and (tmp_path / "step-2" / proof_file(0)).exists()
    checked = counting(monkeypatch, catalog, "check_file")
    with CheckpointManager(CheckpointConfig(tmp_path)) as m:
        restored = m.load()
    assert restored is not None and restored.step == 2 and torch.equal(restored.state["v"], make_state(2)["v"])
    assert checked and not [item for _, item in checked if item.kind == "shard"], "an untouched shard was hashed"

    checked.clear()
    with CheckpointManager(CheckpointConfig(tmp_path, verify="full")) as m:
        assert m.load() is not None
    assert {item.path for _, item in checked if item.kind == "shard"} == {p.name for p in shards(tmp_path, 2)}

    shard = shards(tmp_path, 2)[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    with shard.open("r+b") as out:  # in place: the same inode and size
        out.write(bytes(data))
    with (
        CheckpointManager(CheckpointConfig(tmp_path)) as m,
        pytest.warns(UserWarning, match=r"Skipping step 2 .*distcp.*trying step 1"),
    ):
        restored = m.load()
    assert restored is not None and restored.step == 1


def test_a_durable_resume_reads_this_nodes_proven_shards_locally_without_hashing_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No local commit to resume (its manifest lost), so the durable one loads; the shards this node wrote and
    its proof still vouches for are read from the local disk unhashed, one touched since is hashed first."""
    local, durable = tmp_path / "local", (tmp_path / "durable").as_uri()
    with CheckpointManager(CheckpointConfig(local, durable_url=durable)) as m:
        m.save(3, make_state(3))
        assert m.wait(durable=True)
    (local / "step-3" / "manifest.json").unlink()
    names = {p.name for p in shards(local, 3)}
    assert len(names) >= 1
    hashed = counting(monkeypatch, dcp_fs, "hash_stream")
    caplog.set_level(logging.INFO, logger="resilience.checkpoint.loader")
    with CheckpointManager(CheckpointConfig(local, durable_url=durable)) as m:
        restored = m.load()
    assert restored is not None and restored.tier == "durable" and torch.equal(restored.state["w"], make_state(3)["w"])
    assert not hashed
    assert "from this node's disk" in caplog.text and "from the durable tier" not in caplog.text, caplog.text

    os.utime(shards(local, 3)[0])
    caplog.clear()
    with CheckpointManager(CheckpointConfig(local, durable_url=durable)) as m:
        assert m.load() is not None
    assert len(hashed) == 1, "the touched shard was not hashed again"
    assert "from this node's disk" in caplog.text and "from the durable tier" not in caplog.text, caplog.text


def test_proofs_stay_on_the_node(tmp_path: Path) -> None:
    local, durable = tmp_path / "local", tmp_path / "durable"
    with CheckpointManager(CheckpointConfig(local, durable_url=durable.as_uri())) as m:
        m.save(1, make_state(1))
        assert m.wait(durable=True)
    assert (local / "step-1" / proof_file(0)).exists()
    assert not list((durable / "step-1").glob(".proof-*"))
    manifest = json.loads((local / "step-1" / "manifest.json").read_text())
    assert not [f for f in manifest["files"] if f["path"].startswith(".proof-")]
