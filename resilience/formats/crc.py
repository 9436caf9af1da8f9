"""The zip format's CRC-32 (IEEE), at memory speed where a vectorised implementation is installed.

A Lightning ``.ckpt`` name is a zip archive whose records carry CRC-32s, one pass over every byte of the state.
The shards a name is copied from carry none (torch's own pass, at about 1.5 GB/s, is skipped: nothing reads
them), so the name's writer computes them as it copies the bytes: with zlib-ng (the ``zlib-ng`` package, in
the ``lightning`` extra) at about 20 GB/s, else with the standard library's zlib at about 2 GB/s (0.7 s of a
1.6 GB name). Both compute the same values.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # the optional package is not installed: the standard library's, slower, same values
    from zlib import crc32 as _crc32

_CHUNK = 64 << 20  # bounded pieces: a call on a buffer of several GiB need not be supported


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC-32 of ``data`` continuing from ``value`` (the CRC-32 of the bytes before it)."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CHUNK):
        value = _crc32(view[start : start + _CHUNK], value)
    return value
