"""DCP's local file system writing through :mod:`resilience.persist.direct_io`'s hashed streams.

It lives apart from :mod:`resilience.persist.direct_io` because it subclasses DCP's ``FileSystem``, and importing
``torch.distributed.checkpoint`` takes seconds: ``resilience ls`` and ``verify`` read checkpoints through
``direct_io`` and need none of DCP. ``resilience.persist.direct_io.HashedFileSystem`` still finds it (imported then).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Generator
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystem

from resilience.persist import direct_io
from resilience.persist.direct_io import HashedFileStream, Written


class HashedFileSystem(FileSystem):
    """DCP's local file system whose new files are :class:`HashedFileStream` s; :attr:`written` maps each
    finished file's name (relative to its folder) to its :class:`Written`. Without ``record_crcs`` the entries'
    zip records carry no CRC-32 (:func:`resilience.persist.direct_io._no_zip_crcs`)."""

    def __init__(self, *, direct: bool, fsync: bool, record_crcs: bool = False) -> None:
        super().__init__()
        self.direct = direct
        self.fsync = fsync
        self.record_crcs = record_crcs
        self.written: dict[str, Written] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))

        def done(written: Written) -> None:
            self.written[name] = written

        stream = HashedFileStream(os.fspath(path), direct=self.direct, fsync=self.fsync, done=done)
        try:
            # DCP writes every entry of the file inside this block, in this thread
            with contextlib.nullcontext() if self.record_crcs else direct_io._no_zip_crcs():
                yield stream
        except BaseException:
            stream.abandon()
            raise
        finally:
            stream.close()
