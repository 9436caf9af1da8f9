"""Each rank's files of the newest durable checkpoint, kept in the memory of another node, and read back from there.

With node-local disks a node lost whole takes its ranks' files along, and its replacement would read them from
the durable tier. After each durable commit every rank sends its own files to the server
(:mod:`resilience.storage.peer_server`) of the next node in rank order, so the two copies (the node's disk, the
partner's memory) are never on one node. A load reads each file from the nearest place that holds it unchanged:
this node's disk, a peer's memory, then the durable tier. A peer's bytes count only when their size and
checksum match the durable manifest, so another run's or an older step's copy is passed over, never loaded.

Memory: each node holds its partner node's files of one step, and while a newer step arrives the older one of
the rank sending it, so at most the partner's share of a step plus one rank's share of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import xxhash

from resilience.storage.manifest import FileEntry, Manifest
from resilience.storage.peer_server import PEER_DIR, SERVER_FILE, alive
from resilience.storage.processes import process_start_ticks

log = logging.getLogger(__name__)
Address = tuple[str, int]
START_TIMEOUT_S = 10.0
SOCKET_TIMEOUT_S = 15.0  # each send or receive; a partner cut off costs this much of the peer-copy thread only
# A file read back from a peer stays in memory up to this size (a rank reads one file at a time), then goes to a
# temporary file: a peer's network is faster than this node's disk, which a smaller bound would make the limit.
SPOOL_BYTES = 1 << 30
_CHUNK = 8 << 20


def ensure_server(local_root: str) -> Address | None:
    """This node's server: the one already serving ``local_root`` (it outlives the training processes a launcher
    restarted), else a new one, watching this process's parent (the launcher). None, with a warning, if none
    starts: training goes on, and a lost node's files are read from the durable tier."""
    running = _running(local_root)
    if running is not None:
        return running
    folder = os.path.join(local_root, PEER_DIR)
    os.makedirs(folder, exist_ok=True)
    parent = os.getppid()
    if parent <= 1:  # no launcher (the container's first process, or orphaned): the server ends with this process
        parent = os.getpid()
    ticks = process_start_ticks(parent)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_server.py")
    with open(os.path.join(folder, "server.log"), "ab") as out:
        process = subprocess.Popen(
            [sys.executable, script, local_root, str(parent), "-" if ticks is None else str(ticks)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a launcher's signal to its worker group must not end it
            close_fds=True,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        found = _running(local_root, pid=process.pid)
        if found is not None:
            return found
        time.sleep(0.02)
    log.warning(
        "the peer-copy server did not start (see %s): a lost node's files will be read from the durable tier",
        os.path.join(folder, "server.log"),
    )
    return None


def _running(local_root: str, pid: int | None = None) -> Address | None:
    """The address in ``<local_root>/.peer/server.json``, if its process lives and answers for this root."""
    try:
        with open(os.path.join(local_root, PEER_DIR, SERVER_FILE)) as handle:
            where = json.load(handle)
        if (pid is not None and where["pid"] != pid) or not alive(int(where["pid"]), None):
            return None
        address = (str(where["host"]), int(where["port"]))
        reply = _call(address, {"op": "ping"}, timeout=5.0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return address if reply.get("root") == local_root else None


@contextlib.contextmanager
def _asked(address: Address, request: dict[str, Any], timeout: float = SOCKET_TIMEOUT_S) -> Iterator[socket.socket]:
    """A connection to a server, ``request`` sent (one JSON line); raises OSError on any failure."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(json.dumps(request).encode() + b"\n")
        yield sock


def _call(address: Address, request: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """One request without payload, and its reply."""
    with _asked(address, request, timeout) as sock, sock.makefile("rb") as stream:
        return _reply(stream)


def _reply(stream: IO[bytes]) -> dict[str, Any]:
    line = stream.readline()
    if not line:
        raise ConnectionError("the peer-copy server closed the connection")
    reply: dict[str, Any] = json.loads(line)
    if not reply.get("ok"):
        raise OSError(f"the peer-copy server refused: {reply.get('error')}")
    return reply


def send_copy(address: Address, *, rank: int, run_id: str, step: int, directory: str, files: list[FileEntry]) -> int:
    """Send this rank's ``files`` of committed ``step`` (in ``directory``) to a peer's server; the bytes sent.
    The server replaces this rank's older copy only once this one has arrived whole."""
    request = {
        "op": "put",
        "rank": rank,
        "run_id": run_id,
        "step": step,
        "files": [{"name": f.path, "size": f.size, "xxh3": f.xxh3_64} for f in files],
    }
    with _asked(address, request) as sock:
        for item in files:
            with open(os.path.join(directory, item.path), "rb") as handle:
                sent = sock.sendfile(handle, 0, item.size)
            if sent != item.size:
                raise OSError(f"{item.path}: sent {sent} of {item.size} bytes (the file changed?)")
        with sock.makefile("rb") as stream:
            _reply(stream)
    return sum(f.size for f in files)


class CopySender:
    """Peer copies on a thread of their own, so that a partner node that does not answer (cut off, or gone) costs
    a warning, never the time of the next durable upload. Only the newest copy waits to be sent: an older one not
    yet sent is dropped, as the newer would replace it on the partner anyway.

    Args:
        send: Sends one copy (its arguments as :meth:`submit` got them); raises ``OSError`` when it fails.
    """

    def __init__(self, send: Callable[..., None]):
        self._send = send
        self._next: tuple[Any, ...] | None = None
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, *args: Any) -> None:
        with self._ready:
            self._next = args
            self._ready.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="resilience-peer-copy", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._next is not None)
                args, self._next = self._next, None
            assert args is not None
            self._send(*args)


def held(address: Address, run_id: str) -> list[dict[str, Any]]:
    """What a server holds of run ``run_id``: per sending rank (None: its own disk's), the step and its files
    (names, sizes, checksums)."""
    reply = _call(address, {"op": "index", "run_id": run_id}, timeout=10.0)
    copies: list[dict[str, Any]] = reply["copies"]
    return copies


def partner(nodes: list[str], addresses: dict[str, Address]) -> dict[str, Address]:
    """For each node (by identity, in the order of its lowest rank), the server of the next node that has one:
    a node's files are never kept on the node itself."""
    order = list(dict.fromkeys(nodes))
    found: dict[str, Address] = {}
    for index, node in enumerate(order):
        for other in order[index + 1 :] + order[:index]:
            if other in addresses:
                found[node] = addresses[other]
                break
    return found


@dataclass
class PeerCopies:
    """The files of one durable checkpoint that peers' servers hold unchanged, for a load.

    The servers are asked what they hold once, at the first file looked for; a file counts only if a server holds
    it for the manifest's run and step with the manifest's size and checksum, and its bytes are checked again as
    they arrive. Anything else (a server gone, a mismatch) is read from the durable tier instead.
    """

    addresses: list[Address]
    manifest: Manifest
    step: int
    where: dict[str, Address] | None = None
    fetched: dict[str, int] = field(default_factory=dict)  # name -> bytes, for the load's log line

    def holds(self, name: str) -> bool:
        if self.where is None:
            self.where = self._find(self.addresses)
        return name in self.where

    def _find(self, addresses: Iterable[Address]) -> dict[str, Address]:
        wanted = {f.path: (f.size, f.xxh3_64) for f in self.manifest.files}
        where: dict[str, Address] = {}
        for address in addresses:
            try:
                copies = held(address, self.manifest.run_id or "")
            except (OSError, ValueError, KeyError) as exc:
                log.info("peer-copy server %s:%s not reachable (%s)", *address, exc)
                continue
            for copy in copies:
                if copy["run_id"] != self.manifest.run_id or copy["step"] != self.step:
                    continue
                for item in copy["files"]:
                    if wanted.get(item["name"]) == (item["size"], item["xxh3"]):
                        where.setdefault(item["name"], address)
        return where

    def fetch(self, name: str) -> IO[bytes] | None:
        """The file's bytes from the peer that holds it, checked against the manifest; None if that fails."""
        if not self.holds(name):
            return None
        assert self.where is not None
        address, item = self.where[name], self.manifest.file(name)
        assert item is not None
        copy = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 (handed to the caller)
        try:
            digest, size = _get(address, self.manifest.run_id or "", self.step, name, copy)
            if (size, digest) != (item.size, item.xxh3_64):
                raise OSError(
                    f"it holds {size} bytes with checksum {digest}, the manifest says {item.size}, {item.xxh3_64}"
                )
        except (OSError, ValueError, KeyError) as exc:
            copy.close()
            log.warning(
                "step %d: %s from the peer at %s:%s failed (%s); reading it from the durable tier",
                self.step,
                name,
                *address,
                exc,
            )
            del self.where[name]
            return None
        copy.seek(0)
        self.fetched[name] = size
        return copy


def _get(address: Address, run_id: str, step: int, name: str, copy: IO[bytes]) -> tuple[str, int]:
    """Stream one file from a server into ``copy``, hashing it on the way; its checksum and size."""
    request = {"op": "get", "run_id": run_id, "step": step, "name": name}
    digest = xxhash.xxh3_64()
    with _asked(address, request) as sock, sock.makefile("rb") as stream:
        left = int(_reply(stream)["size"])
        while left:
            chunk = stream.read(min(left, _CHUNK))
            if not chunk:
                raise ConnectionError("the peer-copy server closed the connection mid-file")
            digest.update(chunk)
            copy.write(chunk)
            left -= len(chunk)
    return digest.hexdigest(), copy.tell()


def link_nodes(
    local_root: str, nodes: list[str], rank: int, leader: bool, gather: Callable[[Any], list[Any]]
) -> tuple[Address | None, list[Address]]:
    """Collective (``gather`` is an all-gather): each node's leader makes sure its node's server runs; every rank
    learns every node's server, and the partner's, where its own files go."""
    mine = ensure_server(local_root) if leader else None
    addresses = {
        node: tuple(address)
        for node, address in filter(None, gather((nodes[rank], mine) if leader else None))
        if address
    }
    return partner(nodes, addresses).get(nodes[rank]), list(addresses.values())
