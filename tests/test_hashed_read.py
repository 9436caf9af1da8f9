"""A shard checked as it is read: a durable resume reads each shard once, in order, hashing it on the way, and
uses nothing read from a file whose checksum does not match its manifest."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint import hashed_read
from resilience.errors import CorruptCheckpointError
from resilience.storage import dcp_fs
from resilience.storage.manifest import FileEntry, hash_bytes


def make_state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "large": torch.randn(800, 600, generator=gen),  # 1.9 MB: read straight into its memory
        "small": torch.randn(30, 7, generator=gen).double(),
        "step": step,
    }


def durable_only(tmp_path: Path, steps: tuple[int, ...]) -> CheckpointConfig:
    """Steps committed in the durable tier, with the local copies gone (a replacement node, a lost disk)."""
    config = CheckpointConfig(tmp_path / "local", durable_url=(tmp_path / "durable").as_uri(), keep_last=3)
    with CheckpointManager(config) as m:
        for step in steps:
            m.save(step, make_state(step))
            assert m.wait(durable=True)
    for step in steps:
        shutil.rmtree(tmp_path / "local" / f"step-{step}")
    return config


def test_a_durable_resume_reads_each_shard_once_without_a_private_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old way: each shard copied whole into a temporary file and hashed, then parsed from there."""
    config = durable_only(tmp_path, (1,))
    copies: list[str] = []
    real = dcp_fs._checked_copy

    def counted(entry: Any, item: FileEntry) -> Any:
        copies.append(item.path)
        return real(entry, item)

    monkeypatch.setattr(dcp_fs, "_checked_copy", counted)
    with CheckpointManager(config) as m:
        restored = m.load()
    assert restored is not None and restored.tier == "durable"
    for key in ("large", "small"):
        assert torch.equal(restored.state[key], make_state(1)[key]), key
    assert restored.state["large"].data_ptr() % 4096 == 0
    assert not copies, f"shards copied before use: {copies}"


@pytest.mark.parametrize("where", [0.5, 0.02], ids=["in-a-large-tensor", "in-a-header"])
def test_a_durable_shard_changed_under_its_manifest_is_caught_as_it_is_read(tmp_path: Path, where: float) -> None:
    config = durable_only(tmp_path, (1, 2))
    shard = next((tmp_path / "durable" / "step-2").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[int(len(data) * where)] ^= 0x10  # the same size: only its checksum tells
    shard.write_bytes(bytes(data))
    with (
        CheckpointManager(config) as m,
        pytest.warns(UserWarning, match=r"Skipping step 2 in the durable tier .*checksum.*trying"),
    ):
        restored = m.load()
    assert restored is not None and restored.step == 1
    assert torch.equal(restored.state["large"], make_state(1)["large"])
    assert list((tmp_path / "durable" / "step-2").glob("manifest.json.corrupt-*"))


def test_nothing_is_parsed_or_handed_out_before_the_files_checksum_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = [torch.randn(700, 700), torch.arange(12.0)]
    path = tmp_path / "shard"
    wanted = []
    with open(path, "wb") as out:
        for tensor in tensors:
            out.write(b"\0" * (-out.tell() % 4096))
            start = out.tell()
            torch.save(tensor, out)
            wanted.append(hashed_read.Wanted(start, out.tell() - start, torch.empty_like(tensor)))
    body = path.read_bytes()
    item = FileEntry("shard", len(body), hash_bytes(body), 0, "shard")
    parsed: list[object] = []
    monkeypatch.setattr(hashed_read.torch, "load", lambda *a, **k: parsed.append(a) or torch.zeros(0))

    def refuse(digest: str, size: int) -> None:
        assert (digest, size) == (item.xxh3_64, item.size)  # what was read is exactly the file
        raise CorruptCheckpointError("checksum")

    with open(path, "rb") as stream, pytest.raises(CorruptCheckpointError):
        hashed_read.read_hashed(stream, item, wanted, refuse)
    assert not parsed
    monkeypatch.undo()
    with open(path, "rb") as stream:
        read = hashed_read.read_hashed(stream, item, wanted, lambda digest, size: None)
    assert all(torch.equal(a, b) for a, b in zip(read, tensors, strict=True))
