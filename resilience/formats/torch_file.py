"""A ``torch.save`` file written one tensor at a time, for objects whose tensors do not fit in memory.

``torch.save`` pickles the object first and then writes every storage it met, so it needs all of them in memory.
``torch.serialization.skip_data`` (torch 2.5 and later, a prototype API) writes the same file with the space for each
storage left empty. The object's tensors are the reader's placeholders, ``meta`` tensors with no memory at all, which
the pickler passed to ``torch.save`` (its ``pickle_module``) writes as the CPU tensors they stand for, exactly as
``torch.save`` writes a CPU tensor. The storages are then written into their places: the file is an ordinary zip archive
whose record ``<archive>/data/<key>`` holds storage ``key`` in the order the pickler met them, so a dry run of the same
pickling gives each placeholder its record, and the records' offsets and sizes come from the zip directory. Last, the
CRC-32 of each filled record goes into its data descriptor and the central directory, so the file passes a zip check
(``torch.load`` does not check them).

What it needs: every tensor of the object is a placeholder of the :class:`StepReader` that fills it, or an ordinary
tensor (whose bytes are written from memory). Peak memory is the reader's batch, not the object.
"""

from __future__ import annotations

import collections
import errno
import io
import os
import pickle
import struct
import types
import zipfile
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import torch

from resilience.checkpoint.step_reader import ShardItem, StepReader
from resilience.formats import raw_bytes
from resilience.formats.crc import crc32
from resilience.persist.direct_io import (
    ALIGN,
    aligned_storages,
    copy_range,
    pwrite_aligned,
    pwrite_all,
    reopen_direct,
)
from resilience.persist.record_layout import stored_at, stored_record

_CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_PICKLE_PROTOCOL = 2  # torch.save's default
# The location torch.save records for a placeholder's storage (``str()`` of it): one str object, which the pickle
# memoizes after its first use, as it does the one torch.save records for every CPU storage.
_CPU = "cpu"


def write_torch_file(obj: Any, stream: IO[bytes], reader: StepReader) -> int:
    """``torch.save(obj, stream)`` with ``reader``'s placeholders filled in; ``stream`` is a new, seekable,
    readable binary file. Returns the bytes of tensor data written.

    Each storage's record starts on a 4 KiB boundary, so its whole blocks go to the device with ``O_DIRECT``
    from reused aligned buffers (the rest of the file through ``stream``): a name is the whole state written a
    second time, and through the page cache that costs a page per 4 KiB, as the shards would
    (:mod:`resilience.persist.direct_io`). ``torch.load`` reads any alignment.

    A tensor DCP wrote whole is copied byte for byte from its shard: its entry there is a ``torch.save`` archive
    of the tensor, whose storage record holds exactly these bytes when the tensor was saved contiguous (checked
    in the archive's pickle), and whose CRC-32, where its writer recorded one, is the one the new record needs
    (else it is computed as the bytes go by). Nothing is unpickled into a tensor and no memory is allocated for
    one. Other tensors are read.
    """
    pickling = placeholder_pickling(reader.is_placeholder)
    with torch.serialization.skip_data(), aligned_storages():
        torch.save(obj, stream, pickle_module=pickling, pickle_protocol=_PICKLE_PROTOCOL)
        storages = _storage_order(obj, pickling.Pickler)
    stream.flush()
    records = _records(stream)
    placeholders = [reader.placeholder_of(storage) for storage in storages]
    items = reader.whole_items(p for p in placeholders if p is not None)
    by_file: dict[str, list[tuple[int, ShardItem]]] = {}
    for index, placeholder in enumerate(placeholders):
        if placeholder is not None and id(placeholder) in items:
            item = items[id(placeholder)]
            by_file.setdefault(item.file, []).append((index, item))
    writer = _RecordWriter(stream)
    copied: set[int] = set()
    try:
        for name, group in by_file.items():
            with reader.open_file(name) as source:
                for index, item in sorted(group, key=lambda pair: pair[1].offset):  # one pass through the file
                    stored = stored_record(source, item.offset, item.length, item.shape, item.dtype)
                    if stored is not None:
                        writer.copy(records[str(index)], source, *stored)
                        copied.add(index)
                        if reader.on_bytes is not None:  # copied from the file, not read: still read for the user
                            reader.on_bytes(stored[1])
        for key, value in _values(storages, placeholders, copied, reader):
            writer.write(records[key], raw_bytes(value))
    finally:
        writer.close()
    _patch_crcs(stream.fileno(), records.values())
    return writer.written


class _RecordWriter:
    """Writes records' bytes into the file ``stream`` holds: each record's whole blocks through a second,
    ``O_DIRECT`` descriptor where the file system takes one, the rest through the stream's own."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.fd = stream.fileno()
        self.direct = reopen_direct(stream)
        self.written = 0

    def write(self, record: _Record, data: memoryview) -> None:
        """``data`` (in memory) into ``record``, its CRC-32 computed."""
        if len(data) != record.size:
            raise AssertionError(f"{len(data)} bytes to write into a record of {record.size}")
        record.crc = crc32(data)
        body = self._direct(record, lambda fd, count: pwrite_aligned(fd, data[:count], record.data_offset))
        pwrite_all(self.fd, data[body:], record.data_offset + body)
        self.written += record.size

    def copy(self, record: _Record, source: IO[bytes], start: int, size: int, crc: int | None) -> None:
        """``size`` bytes of ``source`` from ``start`` into ``record``, whose CRC-32 is ``crc`` (None: computed
        from the bytes as they are copied)."""
        if size != record.size:
            raise AssertionError(f"{size} bytes to copy into a record of {record.size}")
        running = [0]

        def seen(chunk: memoryview) -> None:
            running[0] = crc32(chunk, running[0])

        check = seen if crc is None else None
        body = self._direct(record, lambda fd, count: copy_range(source, start, count, fd, record.data_offset, check))
        if body == 0:
            running[0] = 0  # a direct copy refused midway starts again from the first byte
        copy_range(source, start + body, record.size - body, self.fd, record.data_offset + body, check)
        record.crc = running[0] if crc is None else crc
        self.written += record.size

    def _direct(self, record: _Record, send: Callable[[int, int], None]) -> int:
        """Send the record's whole blocks through the direct descriptor; how many bytes went (0: none)."""
        body = record.size - record.size % ALIGN
        if self.direct is None or record.data_offset % ALIGN or not body:
            return 0
        try:
            send(self.direct, body)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            os.close(self.direct)
            self.direct = None  # a file system that opens O_DIRECT but refuses its writes
            return 0
        return body

    def close(self) -> None:
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None


class _Record:
    """Where one storage's bytes go, and where its CRC-32 is recorded twice."""

    def __init__(self, data_offset: int, size: int, descriptor_crc_offset: int, central_crc_offset: int) -> None:
        self.data_offset = data_offset
        self.size = size
        self.descriptor_crc_offset = descriptor_crc_offset
        self.central_crc_offset = central_crc_offset
        self.crc = 0


def placeholder_pickling(is_placeholder: Callable[[Any], bool]) -> Any:
    """A ``pickle_module`` for ``torch.save`` whose pickler writes each tensor ``is_placeholder`` accepts (on the
    ``meta`` device) as the CPU tensor of its shape and dtype: the reduction ``torch.save`` makes of a CPU tensor
    (``Tensor._reduce_ex_internal``), and of a FakeTensor under ``skip_data(materialize_fake_tensors=True)``,
    with the placeholder's storage marked as on the CPU. Under ``skip_data`` that storage's record is left empty
    at its size; without it, ``torch.save`` would try to write a meta storage's bytes."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if not is_placeholder(obj):
                return NotImplemented
            tail: tuple[Any, ...] = (
                obj.storage_offset(),
                tuple(obj.size()),
                obj.stride(),
                obj.requires_grad,
                collections.OrderedDict(),
            )
            storage = obj.untyped_storage()
            if obj.dtype in torch.storage._new_dtypes():
                storage._fake_device = _CPU
                return torch._utils._rebuild_tensor_v3, (storage, *tail, obj.dtype)
            typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=obj.dtype, _internal=True)
            typed._fake_device = _CPU  # type: ignore[assignment]  # torch's load sets a str too
            return torch._utils._rebuild_tensor_v2, (typed, *tail)

    return types.SimpleNamespace(__name__="pickle", Pickler=Pickler)


def _storage_order(obj: Any, pickler: type[pickle.Pickler]) -> list[torch.UntypedStorage]:
    """The storages of ``obj`` in the order ``torch.save`` numbers them (``pickler``'s first encounters)."""
    order: dict[int, torch.UntypedStorage] = {}

    class DryRun(pickler):  # type: ignore[misc, valid-type]
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
    storages: list[torch.UntypedStorage],
    placeholders: list[torch.Tensor | None],
    copied: set[int],
    reader: StepReader,
) -> Iterator[tuple[str, torch.Tensor | torch.UntypedStorage]]:
    """(record key, what to write there) for every storage not ``copied`` (by index), placeholders read through
    ``reader`` in order."""
    keys = {id(p): str(index) for index, p in enumerate(placeholders) if p is not None and index not in copied}
    for index, storage in enumerate(storages):
        if placeholders[index] is None:  # an ordinary tensor inside a value the state kept whole
            yield str(index), storage
    wanted = [p for index, p in enumerate(placeholders) if p is not None and index not in copied]
    for placeholder, value in reader.read(wanted):
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
        data_offset = stored_at(stream, info)
        if data_offset is None:
            raise ValueError(f"torch.save wrote a zip record {info.filename} this writer cannot read")
        stream.seek(data_offset + info.file_size)
        descriptor = stream.read(4)
        descriptor_crc = data_offset + info.file_size + (4 if descriptor == _DESCRIPTOR_SIGNATURE else 0)
        records[key] = _Record(data_offset, info.file_size, descriptor_crc, central[info.filename])
    return records


def _patch_crcs(fd: int, records: Iterable[_Record]) -> None:
    for record in records:
        packed = struct.pack("<L", record.crc)
        os.pwrite(fd, packed, record.descriptor_crc_offset)
        os.pwrite(fd, packed, record.central_crc_offset)
