"""A node's server of checkpoint files to its peers: its partner node's newest ones, kept in memory, and its own
committed ones, from its disk.

With node-local disks, a node lost whole takes its ranks' files with it, and its replacement would read them
from the durable tier (minutes from object storage for a large model). Each rank therefore sends its files of
every durably committed step to this server on another node (:mod:`resilience.storage.peer_copies`), and a
replacement reads them from here, and the surviving nodes' own files from their disks through their servers.

The server must outlive the training processes of its node, which a launcher restarts after any loss: it runs
in a session of its own, so the signals that end a worker group do not reach it, and it ends when the process
it watches (the launcher that started the node's training processes) is gone. Run as a script
(``python peer_server.py ROOT WATCH_PID WATCH_TICKS``): it imports nothing of the pack, so starting it costs no
torch import. It holds, per sending rank, the files of one step, replacing them only once a newer step has
arrived whole; what it keeps is checked by the reader against the durable manifest's checksums, so a stale or
damaged copy is never loaded, only passed over.

Protocol: each request is one line of JSON, then for ``put`` the files' bytes back to back; each reply is one
line of JSON, then for ``get`` the file's bytes. The server listens on every interface of its node, for the
other nodes; it answers only requests that name the run, whose id is in the checkpoint's manifest, so what it
serves is no more than what a reader of the checkpoint already has.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import sys
import threading
import time
from typing import Any

if __package__:
    from resilience.storage.processes import process_start_ticks
else:  # run as a script: its folder is on sys.path, and the pack's package (which imports torch) is not imported
    from processes import process_start_ticks  # type: ignore[no-redef]

PEER_DIR = ".peer"  # in a local root: the peer-copy server's own files
SERVER_FILE = "server.json"  # in PEER_DIR: where this node's server listens
WATCH_INTERVAL_S = 1.0
MAX_HEADER = 1 << 24


def alive(pid: int, ticks: int | None) -> bool:
    """Whether process ``pid`` still runs and is the one that started at ``ticks`` (when known)."""
    now = process_start_ticks(pid)
    if now is not None:
        return ticks is None or now == ticks
    if os.path.isdir("/proc"):
        return False  # Linux: gone, or a zombie
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Copies:
    """The files kept, by sending rank: ``{rank: {"run_id", "step", "files": [{name, size, xxh3}], "data", "round"}}``.

    A round begins when a step newer than every one held arrives; a copy not sent again in its round or the next
    is dropped: its rank now sends elsewhere (the job restarted with other ranks here), and its memory is freed.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_rank: dict[int, dict[str, Any]] = {}
        self.round = 0

    def put(self, rank: int, run_id: str, step: int, files: list[dict[str, Any]], data: dict[str, bytearray]) -> None:
        with self.lock:
            if all(step > copy["step"] for copy in self.by_rank.values()):
                self.round += 1
                self.by_rank = {r: c for r, c in self.by_rank.items() if c["round"] >= self.round - 1}
            self.by_rank[rank] = {"run_id": run_id, "step": step, "files": files, "data": data, "round": self.round}

    def index(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {"rank": rank, "run_id": c["run_id"], "step": c["step"], "files": c["files"]}
                for rank, c in sorted(self.by_rank.items())
            ]

    def get(self, run_id: str, step: int, name: str) -> bytearray | None:
        with self.lock:
            for copy in self.by_rank.values():
                if copy["run_id"] == run_id and copy["step"] == step and name in copy["data"]:
                    data: bytearray = copy["data"][name]
                    return data
        return None


def on_disk(root: str) -> list[dict[str, Any]]:
    """The committed steps this node's disk holds (its own ranks' files), as :meth:`Copies.index` lists copies."""
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        manifest = _manifest(root, name)
        if manifest is not None:
            files = [{"name": f["path"], "size": f["size"], "xxh3": f["xxh3_64"]} for f in manifest["files"]]
            found.append({"rank": None, "run_id": manifest.get("run_id"), "step": manifest["step"], "files": files})
    return found


def _manifest(root: str, name: str) -> dict[str, Any] | None:
    """The parsed manifest of ``<root>/<name>/`` if that is a committed step folder, else None."""
    if not (name.startswith("step-") and name[5:].isdigit()):
        return None
    try:
        with open(os.path.join(root, name, "manifest.json")) as handle:
            manifest: dict[str, Any] = json.load(handle)
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("step") == int(name[5:]) else None


def disk_file(root: str, run_id: str, step: int, name: str) -> str | None:
    """The path of a file of this node's committed ``step`` of run ``run_id`` that its manifest lists."""
    manifest = _manifest(root, f"step-{step}")
    if manifest is None or manifest.get("run_id") != run_id:
        return None
    if not any(f.get("path") == name for f in manifest["files"]) or "/" in name or name in (".", ".."):
        return None
    return os.path.join(root, f"step-{step}", name)


class Handler(socketserver.StreamRequestHandler):
    """One connection: requests until the peer closes it."""

    server: Server

    def handle(self) -> None:
        while True:
            line = self.rfile.readline(MAX_HEADER)
            if not line:
                return
            try:
                request = json.loads(line)
                reply, payload = self.answer(request)
            except (ValueError, KeyError, TypeError, ConnectionError) as exc:
                reply, payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
            try:
                self.reply(reply, payload)
            except OSError:  # the reader went away (or a file on disk did): it reads elsewhere
                return

    def reply(self, reply: dict[str, Any], payload: bytearray | str | None) -> None:
        """The reply's line, then a file's bytes: from memory, or from disk (``payload`` a path)."""
        self.wfile.write(json.dumps(reply).encode() + b"\n")
        if isinstance(payload, str):
            with open(payload, "rb") as handle:
                self.connection.sendfile(handle, 0, reply["size"])
        elif payload is not None:
            self.wfile.write(memoryview(payload))
        self.wfile.flush()

    def answer(self, request: dict[str, Any]) -> tuple[dict[str, Any], bytearray | str | None]:
        op = request["op"]
        copies = self.server.copies
        if op == "ping":
            return {"ok": True, "root": self.server.root, "pid": os.getpid()}, None
        if op == "index":  # of one run only: its id, in the checkpoint's manifest, is what a reader must know
            run_id = str(request["run_id"])
            found = [c for c in copies.index() + on_disk(self.server.root) if c["run_id"] == run_id]
            return {"ok": True, "copies": found}, None
        if op == "get":
            run_id, step, name = str(request["run_id"]), int(request["step"]), str(request["name"])
            data = copies.get(run_id, step, name)
            if data is not None:
                return {"ok": True, "size": len(data)}, data
            path = disk_file(self.server.root, run_id, step, name)
            if path is None:
                return {"ok": False, "error": "not held"}, None
            return {"ok": True, "size": os.path.getsize(path)}, path
        if op == "put":
            files = list(request["files"])
            received = {str(item["name"]): self.receive(int(item["size"])) for item in files}
            copies.put(int(request["rank"]), str(request["run_id"]), int(request["step"]), files, received)
            return {"ok": True}, None
        raise ValueError(f"unknown request {op!r}")

    def receive(self, size: int) -> bytearray:
        """The next ``size`` bytes of the connection, read in place into one buffer."""
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            count = self.rfile.readinto(view[got:])
            if not count:
                raise ConnectionError("the sender closed the connection mid-file")
            got += count
        return buffer


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: str) -> None:
        super().__init__(("", 0), Handler)
        self.root = root
        self.copies = Copies()


def main(root: str, watch_pid: int, watch_ticks: int | None) -> None:
    """Listen on a free port, say where in ``<root>/.peer/server.json``, serve until the watched process ends."""
    server = Server(root)
    folder = os.path.join(root, PEER_DIR)
    os.makedirs(folder, exist_ok=True)
    where = {"host": socket.gethostname(), "port": server.server_address[1], "pid": os.getpid()}
    partial = os.path.join(folder, f".{os.getpid()}.tmp")
    with open(partial, "w") as handle:
        json.dump(where, handle)
    os.replace(partial, os.path.join(folder, SERVER_FILE))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while alive(watch_pid, watch_ticks):
        time.sleep(WATCH_INTERVAL_S)
    server.shutdown()  # its server.json stays: a later start finds its process gone (or not answering)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None)
