"""Checkpoint files written and read past the page cache; shards hashed while they are written.

A buffered write of a checkpoint costs the kernel a page-cache page per 4 KiB: allocated (on a VM, often memory
the host must back anew), filled, written back, and later reclaimed, in whichever process needs memory then,
the training process included. At gigabytes per save that is seconds of system CPU per save on the cores
training uses (issue 18 measured 2.4 s of system time per 1.6 GB written, against 0.1 s with ``O_DIRECT``).
With ``O_DIRECT`` the device reads the bytes from a few reused, page-aligned buffers; nothing is cached, so
nothing has to be reclaimed. Peers that write checkpoints at NVMe speed do the same (DeepSpeed's FastPersist).

The bytes are hashed from those same buffers as they go out, so the commit's checksum costs no second read of
the file (with ``O_DIRECT`` there is no cached copy to read, it would be a read from the device). What the
checksum then vouches for: the bytes this writer handed to the kernel, in order. A file something else wrote
into afterwards no longer matches it, which every later verification finds, as it would with a hash read back.

Where a file system refuses ``O_DIRECT`` (``EINVAL``, at open or at the first write) the same stream writes
through the page cache instead, still hashing as it goes.

The same holds for the files made from a committed step: a Lightning name (the whole state again, in
``torch.save``'s format, whose records :mod:`resilience.formats.torch_file` places on block boundaries for
:func:`pwrite_aligned`) and the reads of a step that is not in the cache (:func:`open_for_read`: a name made
from it, a resume, a verification). A file already cached is read through the cache, which is faster.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import io
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, cast

import numpy
import xxhash

# O_DIRECT wants the buffer's address, the file offset and the length aligned to the device's logical block:
# 4 KiB covers every block size in use (512 B and 4 KiB). Linux-only flag; elsewhere, buffered writes.
ALIGN = 4096
CHUNK = 8 << 20
THROUGH_BYTES = 1 << 20  # a write this large, on a block of the file and of memory, goes out from where it is
_SMALLEST_READ = 64 << 10  # a direct reader's smallest read: small reads in a row still come in few calls
STRAIGHT_READ = 64 << 20  # a direct reader's largest read into its caller's memory (8 MiB reads took 1.5x longer)
O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class Written:
    """What one finished file's writer saw: its checksum and length, and its ``fstat`` right after the last
    write (and fsync), taken through the same descriptor, for the node's proof (:mod:`resilience.storage.proofs`)."""

    xxh3_64: str
    size: int
    stat: os.stat_result


class _Buffers:
    """Page-aligned buffers of ``CHUNK`` bytes, kept for the life of the process and reused by every file: a
    fresh buffer per file would pay its first touch of memory every save."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, CHUNK)  # anonymous maps are page-aligned

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buffer)


_BUFFERS = _Buffers()


class HashedFileStream(io.IOBase):
    """A write-only file stream that hashes what it writes and, with ``direct``, writes it with ``O_DIRECT``.

    Writes gather in an aligned buffer and go out ``CHUNK`` bytes at a time; the unaligned tail goes out at
    :meth:`close` through the page cache (``O_DIRECT`` cleared on the descriptor), then the file is synced if
    ``fsync``. Only then is the file's :class:`Written` reported to ``done``; a stream closed after an error
    reports nothing.
    """

    def __init__(self, path: str, *, direct: bool, fsync: bool, done: Any) -> None:
        super().__init__()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._direct = bool(direct and O_DIRECT)
        try:
            self._fd = os.open(path, flags | (O_DIRECT if self._direct else 0), 0o644)
        except OSError as exc:
            if not self._direct or exc.errno != errno.EINVAL:
                raise
            self._direct = False
            self._fd = os.open(path, flags, 0o644)
        self._buffer = _BUFFERS.take()
        self._view = memoryview(self._buffer)
        self._fill = 0
        self._size = 0
        self._digest = xxhash.xxh3_64()
        self._fsync = fsync
        self._done = done
        self._failed = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        count = len(view)
        taken = 0
        try:
            if count >= THROUGH_BYTES and not self._fill % ALIGN and (not self._direct or not _address(view) % ALIGN):
                taken = self._write_through(view)
            while taken < count:
                step = min(count - taken, CHUNK - self._fill)
                self._view[self._fill : self._fill + step] = view[taken : taken + step]
                self._fill += step
                taken += step
                if self._fill == CHUNK:
                    self._send(CHUNK)
                    self._fill = 0
        except BaseException:
            self.abandon()
            raise
        self._size += count
        return count

    def _write_through(self, view: memoryview) -> int:
        """Hash and write the whole blocks of ``view`` from where they are (a storage on a block boundary of the
        file and of memory, a staging buffer's), not copied into the buffer first; how many bytes went."""
        if self._fill:
            self._send(self._fill)
            self._fill = 0
        blocks = len(view) - len(view) % ALIGN
        for start in range(0, blocks, CHUNK):
            self._out(view[start : min(start + CHUNK, blocks)])
        return blocks

    def abandon(self) -> None:
        """Make :meth:`close` only close: the file is left as it is and never reported (its writer failed)."""
        self._failed = True

    def flush(self) -> None:
        """Nothing to do: the buffer goes out when full or at :meth:`close` (an unaligned flush would end
        ``O_DIRECT`` for the rest of the file)."""

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._failed:
                self._finish()
        finally:
            os.close(self._fd)
            self._view.release()
            _BUFFERS.give(self._buffer)
            super().close()

    def _finish(self) -> None:
        aligned = self._fill - self._fill % ALIGN
        if aligned:
            self._send(aligned)
        if self._fill > aligned:
            self._buffered()
            self._digest.update(self._view[aligned : self._fill])
            self._write_all(self._view[aligned : self._fill])
        if self._fsync:
            os.fsync(self._fd)
        self._done(Written(self._digest.hexdigest(), self._size, os.fstat(self._fd)))

    def _send(self, count: int) -> None:
        """Hash and write the first ``count`` bytes of the buffer (a multiple of ``ALIGN``)."""
        self._out(self._view[:count])

    def _out(self, chunk: memoryview) -> None:
        self._digest.update(chunk)
        self._write_all(chunk)

    def _write_all(self, chunk: memoryview) -> None:
        written = 0
        while written < len(chunk):
            try:
                written += os.write(self._fd, chunk[written:])
            except OSError as exc:
                if not self._direct or exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # this file system takes O_DIRECT at open but not in writes

    def _buffered(self) -> None:
        if self._direct:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~O_DIRECT)
            self._direct = False


def aligned_storages() -> contextlib.AbstractContextManager[Any]:
    """``torch.save`` in this thread, meanwhile, puts each storage's bytes on an ``ALIGN`` boundary of its zip (64 B
    by default), so that a file written from the start of a block keeps them on blocks: they can go to disk with
    ``O_DIRECT`` straight from where they are. ``torch.load`` reads any alignment. torch's settings are the
    thread's own."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # a torch without the setting: its 64 B, and every write through the bounce buffer
        return contextlib.nullcontext()
    if not hasattr(config.save, "storage_alignment"):
        return contextlib.nullcontext()
    return config.patch({"save.storage_alignment": ALIGN})  # type: ignore[attr-defined]


def _no_zip_crcs() -> contextlib.AbstractContextManager[Any]:
    """``torch.save`` in this thread, meanwhile, writes no CRC-32 into its zip records. torch computes it at about
    1.5 GB/s (a second of CPU per 1.6 GB save, in the shard's writer), and nothing reads it: ``torch.load`` does
    not check it, and a load verifies the manifest's checksum of every whole file. torch's settings are the
    thread's own, so nothing else of the process is touched. A name copied from such an entry computes the CRC-32
    its own records need as it copies the bytes (:mod:`resilience.formats.crc`)."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch before 2.6 always computes it
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": False})  # type: ignore[attr-defined]


# ---- reading ------------------------------------------------------------------------------------------------


def open_for_read(path: str) -> IO[bytes]:
    """``path`` opened for reading: past the page cache (:class:`DirectReader`) when the file is not cached,
    as a shard written with ``O_DIRECT`` is not; an ordinary buffered file when it is (a copy in memory is
    faster than the device) or when the file system refuses ``O_DIRECT``.

    Reading a cold file through the cache costs, like writing one, a page-cache page per 4 KiB (here 1.4 s of
    system CPU per 1.6 GB, against 0.04 s with ``O_DIRECT`` at twice the speed).
    """
    if O_DIRECT and not _cached(path):
        try:
            return cast(IO[bytes], DirectReader(path))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return open(path, "rb")


def _cached(path: str) -> bool:
    """Whether most of the file's pages are in the page cache, by ``mincore(2)`` on a read-only shared map of it.

    A map faults nothing in and ``mincore`` only looks, so asking leaves a cold file cold. (A ``RWF_NOWAIT``
    read, the other way to ask, starts readahead on a cold file and answers ``EAGAIN`` for a cached page that is
    locked at that moment, which made a file just read look cold now and then.) The kernel answers for the page
    cache only for a file the caller owns or may write, as here; elsewhere, or where it cannot tell, the answer
    is "not cached", which only picks the slower way to read the same bytes.
    """
    libc = _libc()
    if libc is None:
        return False
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return True
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return False
        try:
            pages = -(-size // mmap.PAGESIZE)
            resident = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, resident) != 0:
                return False
            return 2 * (pages - bytes(resident).count(0)) >= pages  # the low bit; the others are reserved
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's ``mmap``, ``mincore`` and ``munmap``, typed (None where there is no ``mincore``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    except (OSError, AttributeError):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


class SeekableReader(io.RawIOBase):
    """A read-only raw stream of ``length`` bytes that keeps its own position; subclasses read at it."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        position = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence] + offset
        if position < 0:  # as a file answers (zipfile's search for its directory expects an OSError)
            raise OSError(errno.EINVAL, f"negative seek position {position}")
        self._pos = position
        return self._pos


class Window(SeekableReader):
    """``length`` bytes of ``stream`` from its current position, as a file of their own (a DCP entry: the
    ``torch.save`` archive of one tensor, which ``torch.load`` and ``zipfile`` read as a file)."""

    def __init__(self, stream: IO[bytes], length: int):
        super().__init__(length)
        self._stream = stream
        self._start = stream.tell()

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self._length - self._pos)
        if count <= 0:
            return 0
        self._stream.seek(self._start + self._pos)
        got = self._stream.readinto(view[:count])  # type: ignore[attr-defined]
        self._pos += got or 0
        return got or 0


class DirectReader(SeekableReader):
    """A read-only, seekable file read with ``O_DIRECT``, ``CHUNK`` aligned bytes at a time, into one of the
    reused aligned buffers and copied out from there (the caller's buffer need not be aligned).

    No ``fileno``: a caller that would map the file (:func:`resilience.storage.manifest.hash_stream`) reads it instead,
    since a map would fault every page into the cache this reader keeps out of.
    """

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | O_DIRECT | getattr(os, "O_CLOEXEC", 0))
        super().__init__(os.fstat(fd).st_size)
        self._fd = fd
        self._buffer = _BUFFERS.take()
        self._view = memoryview(self._buffer)
        self._start = self._end = 0  # the file's bytes [start, end) are in the buffer

    def readinto(self, target: Any) -> int:
        out = memoryview(target).cast("B")
        wanted = min(len(out), max(self._length - self._pos, 0))
        done = 0
        while done < wanted:
            if not self._start <= self._pos < self._end and (straight := self._read_straight(out[done:wanted])):
                self._pos += straight
                done += straight
                continue
            if not self._start <= self._pos < self._end and not self._fill(wanted - done):
                break
            take = min(wanted - done, self._end - self._pos)
            at = self._pos - self._start
            out[done : done + take] = self._view[at : at + take]
            self._pos += take
            done += take
        return done

    def _read_straight(self, view: memoryview) -> int:
        """Bytes read from the position straight into ``view``, past the buffer, when both start on a block and
        ``view`` holds one; 0 otherwise. A resume reads a large tensor into memory it placed on a block for this
        (:mod:`resilience.checkpoint.loader`): no copy, and large requests that keep the device busy."""
        whole = min(len(view) - len(view) % ALIGN, STRAIGHT_READ)
        if not whole or self._pos % ALIGN or _address(view) % ALIGN:
            return 0
        try:
            return os.preadv(self._fd, [view[:whole]], self._pos)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a block size above ALIGN: through the buffer, which fits it
                raise
            return 0

    def _fill(self, wanted: int) -> bool:
        """Read the aligned blocks from the position on that hold ``wanted`` bytes, at least ``_SMALLEST_READ`` and
        at most ``CHUNK`` of them (a zip directory's few bytes cost no 8 MiB read); False at the end of the file."""
        start = self._pos - self._pos % ALIGN
        size = -(-(self._pos - start + wanted) // ALIGN) * ALIGN
        size = min(max(size, _SMALLEST_READ), CHUNK)
        count = os.preadv(self._fd, [self._view[:size]], start)  # at the end of the file, fewer bytes
        self._start, self._end = start, start + count
        return self._pos < self._end

    def close(self) -> None:
        if self.closed:
            return
        try:
            os.close(self._fd)
        finally:
            self._view.release()
            _BUFFERS.give(self._buffer)
            super().close()


def reopen_direct(stream: IO[bytes]) -> int | None:
    """A second, ``O_DIRECT`` write descriptor on the regular file ``stream`` has open (for its aligned parts,
    while the rest goes through ``stream``); None where there is none to be had."""
    name = getattr(stream, "name", None)
    if not O_DIRECT or not isinstance(name, str):
        return None
    try:
        fd = os.open(name, os.O_WRONLY | O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    if os.path.samestat(os.fstat(fd), os.fstat(stream.fileno())):
        return fd
    os.close(fd)
    return None


def copy_range(
    source: IO[bytes],
    start: int,
    length: int,
    fd: int,
    offset: int,
    seen: Callable[[memoryview], None] | None = None,
) -> None:
    """Copy ``length`` bytes of ``source`` from ``start`` to ``offset`` in ``fd``, through one reused aligned
    buffer: no memory of their own, so a copy of gigabytes touches no fresh page. ``fd`` may be an ``O_DIRECT``
    descriptor (then ``offset`` and ``length`` are whole ``ALIGN`` blocks; ``EINVAL``: the file system takes
    no such write). ``seen`` is shown each chunk, in order, before it is written (to checksum the copy)."""
    source.seek(start)

    def fill(chunk: memoryview, position: int) -> None:
        got = 0
        while got < len(chunk):
            read = source.readinto(chunk[got:])  # type: ignore[attr-defined]
            if not read:
                raise OSError(errno.EIO, f"the file ended {length - position - got} bytes early")
            got += read
        if seen is not None:
            seen(chunk)

    _write_through_buffer(fd, offset, length, fill)


def pwrite_aligned(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` (a whole number of ``ALIGN`` blocks) at ``offset`` (aligned) through an ``O_DIRECT``
    descriptor: from ``data`` itself where it starts on a page (a staging buffer: each is a shared-memory segment
    of its own), else a reused aligned buffer at a time. ``EINVAL``: the file system takes no such write."""
    if _address(data) % ALIGN == 0:
        pwrite_all(fd, data, offset)
        return

    def fill(chunk: memoryview, position: int) -> None:
        chunk[:] = data[position : position + len(chunk)]

    _write_through_buffer(fd, offset, len(data), fill)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``, ``CHUNK`` bytes a call at most (one call writes at most about 2 GiB)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + CHUNK], offset + done)


def _address(data: memoryview) -> int:
    """Where ``data`` starts in this process's memory (read-only views too; 0 for an empty one)."""
    return int(numpy.frombuffer(data, dtype=numpy.uint8).ctypes.data) if len(data) else 0


def _write_through_buffer(fd: int, offset: int, length: int, fill: Callable[[memoryview, int], None]) -> None:
    """Write ``length`` bytes at ``offset`` in ``fd``, one reused aligned buffer of ``CHUNK`` bytes at a time,
    each chunk's bytes put there by ``fill(chunk, its position from the start)``."""
    buffer = _BUFFERS.take()
    view = memoryview(buffer)
    try:
        done = 0
        while done < length:
            chunk = view[: min(CHUNK, length - done)]
            fill(chunk, done)
            pwrite_all(fd, chunk, offset + done)
            done += len(chunk)
            chunk.release()
    finally:
        view.release()
        _BUFFERS.give(buffer)
