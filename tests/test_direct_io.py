"""Shard files written with O_DIRECT and hashed on the way out: the bytes on disk are the bytes given, the
checksum is the file's, a refused O_DIRECT falls back to buffered writes, and a writer that failed reports
nothing, so nothing it left is ever vouched for."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager, direct_io, proofs
from resilience.direct_io import ALIGN, CHUNK, HashedFileStream, Written
from resilience.manifest import Manifest, hash_bytes

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 12345]


def write(path: Path, pieces: list[bytes], **kwargs: Any) -> list[Written]:
    done: list[Written] = []
    stream = HashedFileStream(str(path), done=done.append, **{"direct": True, "fsync": True, **kwargs})
    for piece in pieces:
        assert stream.write(piece) == len(piece)
    assert stream.tell() == sum(map(len, pieces))
    stream.close()
    return done


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("size", SIZES)
def test_the_file_holds_exactly_what_was_written_and_its_checksum_is_the_files(
    tmp_path: Path, size: int, direct: bool
) -> None:
    data = os.urandom(size)
    cut = [0, size // 3, min(size, size // 3 + 7), size]  # pieces that straddle the buffer's edges
    pieces = [data[a:b] for a, b in itertools.pairwise(cut)]
    done = write(tmp_path / "f", pieces, direct=direct)
    assert (tmp_path / "f").read_bytes() == data
    assert len(done) == 1 and done[0].size == size and done[0].xxh3_64 == hash_bytes(data)
    assert done[0].stat.st_ino == os.stat(tmp_path / "f").st_ino


def test_the_shard_is_opened_with_o_direct_where_the_file_system_takes_it(tmp_path: Path) -> None:
    stream = HashedFileStream(str(tmp_path / "f"), direct=True, fsync=False, done=lambda _: None)
    try:
        flags = next(
            int(line.split()[1], 8)
            for line in (Path("/proc/self/fdinfo") / str(stream._fd)).read_text().splitlines()
            if line.startswith("flags:")
        )
        if not stream._direct:
            pytest.skip(f"the file system under {tmp_path} refuses O_DIRECT (the stream fell back, as designed)")
        assert flags & direct_io.O_DIRECT
        stream.write(b"x" * (CHUNK + 10))
    finally:
        stream.close()
    assert (tmp_path / "f").read_bytes() == b"x" * (CHUNK + 10)


def test_a_file_system_refusing_o_direct_at_open_or_at_write_gets_buffered_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open, real_write = os.open, os.write
    refusals: list[str] = []

    def refusing_open(path: str, flags: int, *args: Any) -> int:
        if flags & direct_io.O_DIRECT and "at-open" in path:
            refusals.append("open")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def refusing_write(fd: int, data: Any) -> int:
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT:
            refusals.append("write")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "write", refusing_write)
    data = os.urandom(2 * CHUNK + 5)
    for name in ("at-open", "at-write"):
        done = write(tmp_path / name, [data])
        assert (tmp_path / name).read_bytes() == data and done[0].xxh3_64 == hash_bytes(data)
    assert refusals[0] == "open" and "write" in refusals


def test_a_writer_that_failed_reports_nothing_and_the_file_is_hashed_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = direct_io.HashedFileSystem(direct=True, fsync=False)
    with pytest.raises(RuntimeError, match="serializer broke"), fs.create_stream(tmp_path / "torn", "wb") as stream:
        stream.write(b"a" * (CHUNK + 1))
        raise RuntimeError("serializer broke")
    assert fs.written == {}
    with fs.create_stream(tmp_path / "whole", "wb") as stream:
        stream.write(b"b" * 100)
    assert set(fs.written) == {"whole"}
    # A writer's record whose size the file no longer has is not taken: the file is read and hashed instead.
    (tmp_path / "whole").write_bytes(b"c" * 50)
    entries = proofs.hashed(str(tmp_path), 0, [("whole", "shard")], fs.written)
    assert entries[0].size == 50 and entries[0].xxh3_64 == hash_bytes(b"c" * 50)


def test_a_committed_step_written_past_the_page_cache_verifies_fully_and_its_proof_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.randn(3000, 1000), "b": torch.arange(10.0)}
    config = CheckpointConfig(local_root=tmp_path / "ckpt", persist="thread")
    with CheckpointManager(config) as manager:
        manager.save(1, {"model": state})
        manager.wait()
    step_dir = tmp_path / "ckpt" / "step-1"
    manifest = Manifest.from_json((step_dir / "manifest.json").read_bytes(), where="step 1")
    shards = [f for f in manifest.files if f.kind == "shard"]
    assert shards
    for entry in manifest.files:
        assert hash_bytes((step_dir / entry.path).read_bytes()) == entry.xxh3_64, entry.path
    # The writer's own fstat is what the proof records, so it must equal a later stat of the file. (A small
    # shard is finished within the racy window of its proof and would be hashed again: that rule is off here.)
    monkeypatch.setattr(proofs, "RACY_NS", 0)
    found = proofs.Proofs(str(step_dir))
    assert all(found.holds(entry) for entry in shards)
    with CheckpointManager(CheckpointConfig(local_root=tmp_path / "ckpt", verify="full")) as manager:
        restored = manager.load()
    assert restored is not None and restored.step == 1
    model = restored.state["model"]
    assert torch.equal(model["w"], state["w"]) and torch.equal(model["b"], state["b"])
