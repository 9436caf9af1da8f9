"""Where a tensor's bytes lie in its ``torch.save`` record, found without ``torch.load``.

A DCP entry is a ``torch.save`` archive of one tensor: a zip whose pickle describes the tensor and whose storage
record holds its bytes. Reading the pickle with an allow-list that resolves only what a pickled tensor names, and
builds nothing, gives where those bytes are. A Lightning name is then copied from the shard byte for byte
(:mod:`resilience.formats.torch_file`), and a resume reads a large tensor's bytes straight into the memory that
becomes the tensor (:mod:`resilience.checkpoint.loader`), each without running ``torch.load``'s unpickler or
copying the bytes a second time.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from typing import IO, Any

import torch

from resilience.persist.direct_io import Window

LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIGNATURE = b"PK\x03\x04"


def stored_record(
    source: IO[bytes], offset: int, length: int, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[int, int, int | None] | None:
    """(offset in the shard, size, CRC-32) of the storage record of the DCP entry of ``length`` bytes at ``offset``
    when it holds exactly the tensor's bytes in row-major order: the tensor was pickled at storage offset 0 with
    contiguous strides, the ``dtype`` and ``shape`` the metadata gives, over a stored (uncompressed) record of its
    size. None otherwise, or for anything this reader does not know (the tensor is then read instead). The CRC-32
    is None where the entry's writer recorded none (0 for bytes whose CRC is not 0: torch's ``compute_crc32`` off,
    as in our helper)."""
    source.seek(offset)
    window = Window(source, length)
    try:
        archive = zipfile.ZipFile(window)
        pickles = [info for info in archive.infolist() if info.filename.rpartition("/")[2] == "data.pkl"]
        if len(pickles) != 1:
            return None
        pickled = stored_at(window, pickles[0])
        if pickled is None:
            return None
        window.seek(pickled)
        layout = TensorLayout.of(window.read(pickles[0].file_size))
        prefix = pickles[0].filename[: -len("data.pkl")]
        info = archive.getinfo(f"{prefix}data/{layout.storage}") if layout is not None else None
    except (zipfile.BadZipFile, KeyError, ValueError, EOFError, struct.error):
        return None
    nbytes = math.prod(shape) * dtype.itemsize
    if layout is None or info is None or not layout.is_whole(shape, dtype) or info.file_size != nbytes:
        return None
    at = stored_at(window, info)
    if at is None:
        return None
    crc = None if info.CRC == 0 and nbytes else info.CRC  # a CRC-32 of 0 is rare enough to compute again
    return offset + at, nbytes, crc


def stored_at(archive: IO[bytes] | io.RawIOBase, info: zipfile.ZipInfo) -> int | None:
    """Where the bytes of the uncompressed record ``info`` start in ``archive`` (read from its local header, not
    through ``zipfile``, which would check a CRC-32 that torch may not have written); None if compressed."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    archive.seek(info.header_offset)
    fields = LOCAL_HEADER.unpack(archive.read(LOCAL_HEADER.size))
    if fields[0] != _LOCAL_SIGNATURE:
        return None
    return info.header_offset + LOCAL_HEADER.size + fields[10] + fields[11]


@dataclass(frozen=True)
class TensorLayout:
    """How the pickle of a ``torch.save`` of one tensor lays it over its storage."""

    storage: str  # the storage's record key
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def is_whole(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """The tensor is its whole storage, row-major, as ``shape`` and ``dtype``."""
        contiguous, step = [], 1
        for length in reversed(shape):
            contiguous.append(step)
            step *= length
        return (
            self.dtype == dtype
            and self.offset == 0
            and self.size == tuple(shape)
            and self.stride == tuple(reversed(contiguous))
        )

    @classmethod
    def of(cls, data: bytes) -> TensorLayout | None:
        """The layout that pickle ``data`` describes, or None if it is anything but one such tensor: only the
        names a tensor's pickle uses are resolved, and nothing is built (no storage is read)."""
        try:
            found = _LayoutUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, TypeError, ValueError, IndexError, EOFError):
            return None
        return found if isinstance(found, cls) else None


class _StorageType:
    """What the pickle names as a storage's class: a legacy typed storage (its dtype), or UntypedStorage."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype | None


@functools.cache
def _legacy_storage_dtypes() -> dict[str, torch.dtype]:
    """``FloatStorage`` -> ``torch.float32`` and the like (asking a legacy class warns that it is deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        legacy = torch.storage._LegacyStorage
        return {
            cls.__name__: cls.dtype
            for cls in vars(torch).values()
            if isinstance(cls, type) and issubclass(cls, legacy) and cls is not legacy
        }


def _layout_v2(storage: _StorageRef, offset: int, size: Any, stride: Any, *args: Any) -> TensorLayout:
    if storage.dtype is None:
        raise pickle.UnpicklingError("an untyped storage without the dtype _rebuild_tensor_v3 gives")
    return TensorLayout(storage.key, storage.dtype, int(offset), tuple(size), tuple(stride))


def _layout_v3(
    storage: _StorageRef, offset: int, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *args: Any
) -> TensorLayout:
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"{dtype!r} is not a dtype")
    return TensorLayout(storage.key, dtype, int(offset), tuple(size), tuple(stride))


class _LayoutUnpickler(pickle.Unpickler):
    """Resolves only what a pickled tensor refers to, into stand-ins that record its layout."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _layout_v2 if name.endswith("v2") else _layout_v3
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageType(None)
        if module == "torch" and name in _legacy_storage_dtypes():
            return _StorageType(_legacy_storage_dtypes()[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a pickled tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"persistent id {pid!r} is not a storage")
        return _StorageRef(str(pid[2]), pid[1].dtype)
