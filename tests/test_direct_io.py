"""Shard files written with O_DIRECT and hashed on the way out: the bytes on disk are the bytes given, the
checksum is the file's, a refused O_DIRECT falls back to buffered writes, and a writer that failed reports
nothing, so nothing it left is ever vouched for."""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.serialization import config as serialization_config

from resilience import CheckpointConfig, CheckpointManager
from resilience.formats import raw_bytes, torch_file
from resilience.formats.export import write_name
from resilience.persist import direct_io, record_layout
from resilience.persist.direct_io import ALIGN, CHUNK, THROUGH_BYTES, HashedFileStream, Written
from resilience.storage import proofs
from resilience.storage.dcp_fs import HashedFileSystem
from resilience.storage.manifest import Manifest, hash_bytes, hash_stream
from resilience.storage.tiers import LocalTier

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


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_large_storage_on_a_block_goes_out_from_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """A piece of a MiB or more that starts on a block of the file and of memory (a large tensor's storage from a
    staging buffer) is hashed and written in place; one off a block of the file or of memory goes through the
    buffer. The file and its checksum are the bytes written, in order, either way."""
    through: list[int] = []
    real = HashedFileStream._write_through
    monkeypatch.setattr(
        HashedFileStream, "_write_through", lambda self, view: through.append(len(view)) or real(self, view)
    )
    paged = mmap.mmap(-1, 2 * CHUNK + 2 * ALIGN)  # anonymous maps start on a page
    paged[:] = os.urandom(len(paged))
    on_block, off_memory = memoryview(paged)[: 2 * CHUNK + 100], memoryview(paged)[64 : 64 + CHUNK]
    smallest = memoryview(paged)[:THROUGH_BYTES]  # after off_memory, the file is on a block again
    pieces = [os.urandom(ALIGN), on_block, b"tail", on_block, os.urandom(ALIGN - 204), off_memory, smallest]
    done = write(tmp_path / "f", pieces, direct=direct)
    data = b"".join(bytes(piece) for piece in pieces)
    assert (tmp_path / "f").read_bytes() == data and done[0].xxh3_64 == hash_bytes(data)
    # the second large piece follows 4 bytes of tail: off a block of the file; the last is off a page of memory,
    # which only O_DIRECT minds
    assert through == ([len(on_block), THROUGH_BYTES] if direct else [len(on_block), len(off_memory), THROUGH_BYTES])


def test_aligned_blocks_go_out_from_page_aligned_memory_itself_and_from_other_memory_through_a_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name's tensor from a staging buffer (a segment of its own, so on a page) is written without a copy; one
    elsewhere is copied through the reused aligned buffer. Both land byte for byte, past the page cache."""
    copies: list[int] = []
    real = direct_io._write_through_buffer
    monkeypatch.setattr(direct_io, "_write_through_buffer", lambda fd, *a: copies.append(fd) or real(fd, *a))
    blocks = 2 * CHUNK // ALIGN + 3
    paged = mmap.mmap(-1, blocks * ALIGN + ALIGN)  # anonymous maps start on a page
    paged[:] = os.urandom(len(paged))
    path = tmp_path / "name"
    path.write_bytes(b"")
    fd = os.open(path, os.O_WRONLY | direct_io.O_DIRECT)
    try:
        direct_io.pwrite_aligned(fd, memoryview(paged)[: blocks * ALIGN], 0)
        assert copies == []
        direct_io.pwrite_aligned(fd, memoryview(paged)[64 : 64 + ALIGN], blocks * ALIGN)  # not on a page
        assert copies == [fd]
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        pytest.skip(f"the file system under {tmp_path} refuses O_DIRECT writes")
    finally:
        os.close(fd)
    assert path.read_bytes() == paged[: blocks * ALIGN] + paged[64 : 64 + ALIGN]


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
    fs = HashedFileSystem(LocalTier(tmp_path), direct=True, fsync=False)
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


def test_a_committed_step_written_past_the_page_cache_verifies_fully_and_its_proof_holds(tmp_path: Path) -> None:
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
    # The writer's own fstat is what the proof records, so it must equal a later stat of the file.
    found = proofs.Proofs(str(step_dir))
    assert all(found.holds(entry) for entry in shards)
    with CheckpointManager(CheckpointConfig(local_root=tmp_path / "ckpt", verify="full")) as manager:
        restored = manager.load()
    assert restored is not None and restored.step == 1
    model = restored.state["model"]
    assert torch.equal(model["w"], state["w"]) and torch.equal(model["b"], state["b"])


# ---- reading past the page cache, and names written with aligned records ---------------------------------------


def _evicted(path: Path) -> None:
    """Drop the file's pages from the page cache (no root needed: its pages are clean once synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_reader_or_skip(path: Path) -> direct_io.DirectReader:
    try:
        return direct_io.DirectReader(str(path))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"the file system under {path} refuses O_DIRECT reads")
        raise


@pytest.mark.parametrize("size", [0, 1, ALIGN + 1, CHUNK + 12345, 2 * CHUNK])
def test_a_direct_reader_reads_the_files_bytes_at_any_position(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    with _direct_reader_or_skip(tmp_path / "f") as reader:
        assert reader.read() == data
        for start, length in [(0, 5), (size // 2, ALIGN + 3), (max(size - 3, 0), 10), (size + 5, 4), (3, CHUNK)]:
            assert reader.seek(start) == start
            assert reader.read(length) == data[start : start + length]
            assert reader.tell() == min(start + length, max(size, start))
        assert reader.seek(-1, os.SEEK_END) == size - 1 if size else reader.seek(0, os.SEEK_END) == 0
        with pytest.raises(OSError, match="negative seek"):
            reader.seek(-1)
    with open(tmp_path / "f", "rb") as plain, direct_io.DirectReader(str(tmp_path / "f")) as reader:
        assert hash_stream(reader) == hash_stream(plain) == (hash_bytes(data), size)


def test_a_direct_reader_reads_into_block_aligned_memory_without_its_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(2 * CHUNK + 3 * ALIGN + 5)
    (tmp_path / "f").write_bytes(data)
    fills: list[int] = []
    real_fill = direct_io.DirectReader._fill

    def counted(self: direct_io.DirectReader, wanted: int) -> bool:
        fills.append(wanted)
        return real_fill(self, wanted)

    monkeypatch.setattr(direct_io.DirectReader, "_fill", counted)
    target = mmap.mmap(-1, len(data))  # page-aligned
    with _direct_reader_or_skip(tmp_path / "f") as reader:
        reader.seek(ALIGN)
        body = len(data) - ALIGN - 5  # whole blocks
        assert reader.readinto(memoryview(target)[:body]) == body
        assert not fills, "an aligned read into aligned memory went through the buffer"
        assert reader.readinto(memoryview(target)[body : body + 100]) == 5  # the tail, through the buffer
        assert fills
        assert target[: body + 5] == data[ALIGN:]
        reader.seek(ALIGN + 1)  # the file's position off its block: through the buffer, still right
        assert reader.readinto(memoryview(target)[: 2 * ALIGN]) == 2 * ALIGN
        assert target[: 2 * ALIGN] == data[ALIGN + 1 : 3 * ALIGN + 1]


def test_a_file_out_of_the_cache_is_read_past_it_and_a_cached_one_through_it(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * ALIGN))
    _direct_reader_or_skip(path).close()
    _evicted(path)
    if direct_io._cached(str(path)):
        pytest.skip("this kernel keeps the file cached after POSIX_FADV_DONTNEED")
    assert not direct_io._cached(str(path)), "asking whether a file is cached must read none of it in"
    with direct_io.open_for_read(str(path)) as cold:
        assert isinstance(cold, direct_io.DirectReader)
        cold_bytes = cold.read()
    path.read_bytes()  # now in the cache
    assert direct_io._cached(str(path))
    with direct_io.open_for_read(str(path)) as warm:
        assert not isinstance(warm, direct_io.DirectReader)
        assert warm.read() == cold_bytes == path.read_bytes()


def test_a_refused_o_direct_read_opens_the_file_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "f").write_bytes(b"abc")

    def refused(path: str) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io, "_cached", lambda path: False)
    monkeypatch.setattr(direct_io, "DirectReader", refused)
    with direct_io.open_for_read(str(tmp_path / "f")) as stream:
        assert stream.read() == b"abc"


@pytest.mark.parametrize("crc", [True, False], ids=["shard-crcs", "no-shard-crcs"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_a_name_is_a_valid_zip_with_aligned_records_that_loads_as_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, crc: bool
) -> None:
    """The engine writes its shards' zip records without CRC-32s (torch computing them cost a second of CPU per
    1.6 GB): the name, copied from them, computes its own; with ``crc`` the shards have them and it takes theirs."""
    if not direct:
        monkeypatch.setattr(torch_file, "reopen_direct", lambda stream: None)
    if crc:
        monkeypatch.setattr(direct_io, "_no_zip_crcs", contextlib.nullcontext)
    state = {"w": torch.randn(1000, 999), "b": torch.arange(7.0), "tied": None, "n": 3}
    state["tied"] = state["w"]
    ways: list[tuple[str, int]] = []
    for way in ("write", "copy"):
        original = getattr(torch_file._RecordWriter, way)

        def spy(self: Any, record: Any, *args: Any, way: str = way, original: Any = original) -> None:
            ways.append((way, record.size))
            original(self, record, *args)

        monkeypatch.setattr(torch_file._RecordWriter, way, spy)
    with CheckpointManager(CheckpointConfig(local_root=tmp_path / "ckpt", persist="thread")) as manager:
        manager.save(1, {"state_dict": state}, extra={"adapter": "lightning"})
        manager.wait()
        assert _shard_crcs(tmp_path / "ckpt" / "step-1", "state_dict/w") == ([] if crc else [0])
        _evicted(next((tmp_path / "ckpt" / "step-1").glob("*.distcp")))  # the name reads it past the cache
        write_name(manager.local, 1, str(tmp_path / "n.ckpt"), ["state_dict"], {}, verify=True, allow_pickle=False)
    # w and b were each written whole into a shard entry: their bytes are copied from there
    assert sorted(ways) == [("copy", 7 * 4), ("copy", 1000 * 999 * 4)], ways
    archive = zipfile.ZipFile(tmp_path / "n.ckpt")
    assert archive.testzip() is None  # every record's CRC-32 is its bytes'
    for info in archive.infolist():
        if "/data/" in info.filename:
            with open(tmp_path / "n.ckpt", "rb") as raw:
                raw.seek(info.header_offset + 26)
                name_length, extra_length = struct.unpack("<2H", raw.read(4))
            assert (info.header_offset + 30 + name_length + extra_length) % ALIGN == 0, info.filename
    loaded = torch.load(tmp_path / "n.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["n"] == 3
    assert loaded["tied"].data_ptr() == loaded["w"].data_ptr()


@pytest.mark.parametrize(
    ("tensor", "whole"),
    [
        (torch.randn(30, 40), True),
        (torch.zeros(5, dtype=torch.float8_e4m3fn), True),
        (torch.randn(40, 30).t(), False),  # pickled with its strides over a storage in another order
        (torch.randn(50)[10:30], False),  # pickled at an offset into a larger storage
    ],
    ids=["contiguous", "float8", "transposed", "slice"],
)
def test_a_shard_entry_is_copied_only_when_its_record_holds_exactly_the_tensors_bytes(
    tmp_path: Path, tensor: torch.Tensor, whole: bool
) -> None:
    path = tmp_path / "shard"
    with open(path, "wb") as out:
        out.write(b"x" * 100)  # an entry starts anywhere in a shard
        torch.save(tensor, out)
        length = out.tell() - 100
    with open(path, "ab") as out, serialization_config.patch({"save.compute_crc32": False}):
        start = out.tell()
        torch.save(tensor, out)  # the same entry again, its records without CRC-32s (as the helper writes them)
        unchecked = out.tell() - start
    shape = tuple(tensor.shape)
    with open(path, "rb") as source:
        found = record_layout.stored_record(source, 100, length, shape, tensor.dtype)
        found_again = record_layout.stored_record(source, start, unchecked, shape, tensor.dtype)
    if not whole:
        assert found is None and found_again is None
        return
    assert found is not None and found_again is not None
    offset, size, crc = found
    data = path.read_bytes()[offset : offset + size]
    assert size == tensor.nbytes and data == bytes(raw_bytes(tensor)) and crc == zlib.crc32(data)
    offset, size, crc = found_again
    assert path.read_bytes()[offset : offset + size] == data and crc is None


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (str(self.marker),))


def test_the_layout_of_a_shard_entry_is_read_without_running_what_its_pickle_names(tmp_path: Path) -> None:
    assert record_layout.TensorLayout.of(pickle.dumps(_Planted(tmp_path / "ran"), protocol=2)) is None
    assert not (tmp_path / "ran").exists()


def _shard_crcs(step_dir: Path, key: str) -> list[int]:
    """The CRC-32s of the storage records in the DCP entry of ``key`` (non-zero ones left out)."""
    metadata = FileSystemReader(str(step_dir)).read_metadata()
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == key]
    with open(step_dir / info.relative_path, "rb") as stream:
        stream.seek(info.offset)
        archive = zipfile.ZipFile(direct_io.Window(stream, info.length))  # type: ignore[arg-type]
        return [i.CRC for i in archive.infolist() if "/data/" in i.filename and i.filename[-1].isdigit() and not i.CRC]
