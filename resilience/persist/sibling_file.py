"""Where the first rank of a node tells its sibling ranks about its fork server
(:class:`~resilience.persist.fork_server.SiblingServer`).

torchrun, ``accelerate launch`` and ``resilience launch`` start every rank of a node from one launcher process, so
no rank can hand its server to another through the environment, as Lightning's first rank does to the ranks it
starts. The first rank writes the server's address and key to a file named for the launcher (its pid and start
time: a later launcher given the same pid has another name), which the other ranks read. The file is this user's
alone (its key lets whoever reads it have helpers forked), in a folder of this user's alone; it is written whole
(a temporary file renamed), and removed when the server stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile

from resilience.storage.processes import process_start_ticks


def sibling_path() -> str | None:
    """The file of this node's ranks, or None where a launcher did not start several ranks of the node as siblings
    (``LOCAL_WORLD_SIZE`` above 1; Lightning's own launcher starts its ranks from the first), or where this user
    has no private folder to keep it in."""
    try:
        if int(os.environ.get("LOCAL_WORLD_SIZE") or 1) < 2:
            return None
    except ValueError:
        return None
    launcher = os.getppid()
    ticks = process_start_ticks(launcher)
    folder = _private_folder()
    if ticks is None or folder is None:
        return None
    return os.path.join(folder, f"server-{launcher}-{ticks}.json")


def first_sibling() -> bool:
    """Whether this is the first of the ranks its launcher started on this node (``LOCAL_RANK`` 0), which
    publishes its server. Not ``SLURM_LOCALID``: that numbers the launchers SLURM started, not their ranks."""
    return os.environ.get("LOCAL_RANK", "0") in ("", "0")


def publish(path: str, text: str) -> None:
    """Write ``text`` to ``path``, whole: a reader sees the old file, the new one or none, never a part."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".server-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def read(path: str) -> str | None:
    """The file's text, if there is one this user wrote (and no other user can have written), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as handle:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            return None
        return handle.read()


def remove(path: str, address: str) -> None:
    """Remove the file if it still names the server listening at ``address`` (a later first rank may have
    published its own since)."""
    try:
        current = json.loads(read(path) or "{}").get("address")
    except ValueError:
        return
    if current == address:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _private_folder() -> str | None:
    """A folder only this user can enter, in the temporary folder (made if need be), or None if the one of that
    name is another's or others may enter it."""
    folder = os.path.join(tempfile.gettempdir(), f"resilience-{os.getuid()}")
    with contextlib.suppress(OSError):  # there already, or not to be made: lstat tells
        os.mkdir(folder, 0o700)
    try:
        info = os.lstat(folder)
    except OSError:
        return None
    private = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
    return folder if private else None
