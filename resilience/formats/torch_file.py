"""A ``torch.save`` file written one tensor at a time, for objects whose tensors do not fit in memory.

``torch.save`` pickles the object first and then writes every storage it met, so it needs all of them in
memory. ``torch.serialization.skip_data`` (torch 2.5 and later, a prototype API) writes the same file with
the space for each storage left empty, and with ``materialize_fake_tensors=True`` it takes FakeTensors, which
have no memory at all. The storages are then written into their places: the file is an ordinary zip archive
whose record ``<archive>/data/<key>`` holds storage ``key`` in the order the pickler met them, so a dry run
of the same pickling gives each placeholder its record, and the records' offsets and sizes come from the
zip directory. Last, the CRC-32 of each filled record goes into its data descriptor and the central
directory, so the file passes a zip check (``torch.load`` does not check them).

What it needs: every tensor of the object is a placeholder of the :class:`StepReader` that fills it, or an
ordinary tensor (whose bytes are written from memory). Peak memory is the reader's batch, not the object.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from typing import IO, Any

import torch

from resilience.direct_io import ALIGN, pwrite_aligned, reopen_direct
from resilience.formats import raw_bytes
from resilience.step_reader import StepReader

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"
_CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_CHUNK = 64 << 20
_PICKLE_PROTOCOL = 2  # torch.save's default


def write_torch_file(obj: Any, stream: IO[bytes], reader: StepReader) -> int:
    """``torch.save(obj, stream)`` with ``reader``'s placeholders filled in; ``stream`` is a new, seekable,
    readable binary file. Returns the bytes of tensor data written.

    Each storage's record starts on a 4 KiB boundary, so its whole blocks go to the device with ``O_DIRECT``
    from reused aligned buffers (the rest of the file through ``stream``): a name is the whole state written a
    second time, and through the page cache that costs a page per 4 KiB, as the shards would
    (:mod:`resilience.direct_io`). ``torch.load`` reads any alignment.
    """
    with torch.serialization.skip_data(materialize_fake_tensors=True), _aligned_records():
        torch.save(obj, stream, pickle_protocol=_PICKLE_PROTOCOL)
        storages = _storage_order(obj)
    stream.flush()
    records = _records(stream)
    fd = stream.fileno()
    direct = reopen_direct(stream)
    written = 0
    try:
        for key, value in _values(storages, reader):
            record = records[key]
            data = raw_bytes(value)
            if len(data) != record.size:
                raise AssertionError(f"storage {key}: {len(data)} bytes to write into a record of {record.size}")
            record.crc = _crc32(data)
            body = 0  # the record's whole blocks, written past the cache where it can be
            if direct is not None and record.data_offset % ALIGN == 0:
                body = len(data) - len(data) % ALIGN
                try:
                    pwrite_aligned(direct, data[:body], record.data_offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    os.close(direct)
                    direct, body = None, 0  # a file system that opens O_DIRECT but refuses its writes
            _pwrite_all(fd, data[body:], record.data_offset + body)
            written += len(data)
    finally:
        if direct is not None:
            os.close(direct)
    _patch_crcs(fd, records.values())
    return written


def _aligned_records() -> contextlib.AbstractContextManager[Any]:
    """``torch.save`` placing storages on ``ALIGN`` boundaries (its setting since torch 2.6; 64 B before). The
    setting is global: a ``torch.save`` elsewhere in the process meanwhile gets the same (valid) alignment."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return contextlib.nullcontext()
    return config.patch({"save.storage_alignment": ALIGN})  # type: ignore[attr-defined]


class _Record:
    """Where one storage's bytes go, and where its CRC-32 is recorded twice."""

    def __init__(self, data_offset: int, size: int, descriptor_crc_offset: int, central_crc_offset: int) -> None:
        self.data_offset = data_offset
        self.size = size
        self.descriptor_crc_offset = descriptor_crc_offset
        self.central_crc_offset = central_crc_offset
        self.crc = 0


def _storage_order(obj: Any) -> list[torch.UntypedStorage]:
    """The storages of ``obj`` in the order ``torch.save`` numbers them (its pickler's first encounters)."""
    order: dict[int, torch.UntypedStorage] = {}

    class DryRun(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.storage.TypedStorage):
                value = value._untyped_storage
            if isinstance(value, torch.UntypedStorage):
                order.setdefault(value._cdata, value)
                return str(value._cdata)
            return None

    DryRun(io.BytesIO(), protocol=_PICKLE_PROTOCOL).dump(obj)
    return list(order.values())


def _values(
    storages: list[torch.UntypedStorage], reader: StepReader
) -> Iterator[tuple[str, torch.Tensor | torch.UntypedStorage]]:
    """(record key, what to write there) for every storage, placeholders read through ``reader`` in order."""
    placeholders = [reader.placeholder_of(storage) for storage in storages]
    keys = {id(p): str(index) for index, p in enumerate(placeholders) if p is not None}
    for index, storage in enumerate(storages):
        if placeholders[index] is None:  # an ordinary tensor inside a value the state kept whole
            yield str(index), storage
    for placeholder, value in reader.read(p for p in placeholders if p is not None):
        yield keys[id(placeholder)], value


def _records(stream: IO[bytes]) -> dict[str, _Record]:
    """Storage key -> its record, read from the zip archive that ``torch.save`` wrote."""
    archive = zipfile.ZipFile(stream)
    central: dict[str, int] = {}
    stream.seek(archive.start_dir)
    for _ in archive.infolist():
        fixed = stream.read(_CENTRAL_HEADER.size)
        fields = _CENTRAL_HEADER.unpack(fixed)
        if fields[0] != _CENTRAL_SIGNATURE:
            raise ValueError("torch.save wrote a zip central directory this writer cannot read")
        name_length, extra_length, comment_length = fields[12], fields[13], fields[14]
        name = stream.read(name_length).decode()
        central[name] = stream.tell() - name_length - _CENTRAL_HEADER.size + 16
        stream.seek(extra_length + comment_length, os.SEEK_CUR)
    records: dict[str, _Record] = {}
    for info in archive.infolist():
        directory, _, key = info.filename.rpartition("/")
        if not directory.endswith("/data") and directory != "data":
            continue
        stream.seek(info.header_offset)
        fields = _LOCAL_HEADER.unpack(stream.read(_LOCAL_HEADER.size))
        if fields[0] != _LOCAL_SIGNATURE:
            raise ValueError(f"torch.save wrote a zip record {info.filename} this writer cannot read")
        data_offset = info.header_offset + _LOCAL_HEADER.size + fields[10] + fields[11]
        stream.seek(data_offset + info.file_size)
        descriptor = stream.read(4)
        descriptor_crc = data_offset + info.file_size + (4 if descriptor == _DESCRIPTOR_SIGNATURE else 0)
        records[key] = _Record(data_offset, info.file_size, descriptor_crc, central[info.filename])
    return records


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at ``offset`` (in pieces: one call writes at most about 2 GiB)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _CHUNK], offset + done)


def _crc32(data: memoryview) -> int:
    crc = 0
    for start in range(0, len(data), _CHUNK):
        crc = zlib.crc32(data[start : start + _CHUNK], crc)
    return crc


def _patch_crcs(fd: int, records: Iterable[_Record]) -> None:
    for record in records:
        packed = struct.pack("<L", record.crc)
        os.pwrite(fd, packed, record.descriptor_crc_offset)
        os.pwrite(fd, packed, record.central_crc_offset)
