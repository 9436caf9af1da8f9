"""The zip format's CRC-32 (IEEE), at memory speed where a vectorised implementation is installed.

A Lightning ``.ckpt`` name is a zip archive whose records carry CRC-32s, one pass over every byte of the state.
The standard library's zlib computes them at about 2 GB/s on one core (0.7 s of a named save's 1.6 GB, and
on the critical path of the last save of a fit); zlib-ng's (the ``zlib-ng`` package, in the ``lightning``
extra) at about 20 GB/s. Both compute the same values. :data:`FAST` lets a save decide where the CRC-32s of a
name are cheapest: computed by the name's writer as it copies the bytes (fast here), or recorded by torch's
own slower pass when the shards are written (see ``CheckpointManager.save``'s ``record_crcs``).
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32 as _crc32

    FAST = True
except ImportError:  # the optional package is not installed: the standard library's, slower, same values
    from zlib import crc32 as _crc32

    FAST = False

_CHUNK = 64 << 20  # bounded pieces: a call on a buffer of several GiB need not be supported


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC-32 of ``data`` continuing from ``value`` (the CRC-32 of the bytes before it)."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CHUNK):
        value = _crc32(view[start : start + _CHUNK], value)
    return value
