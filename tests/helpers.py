"""Launching real multi-process jobs and a real S3-protocol server for the tests."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from resilience.storage.tiers import Tier

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def start_ranks(
    script: str | Path,
    args: Sequence[str],
    world_size: int,
    *,
    env: dict[str, str] | None = None,
    output_dir: Path | None = None,
) -> list[subprocess.Popen[str]]:
    """Start ``world_size`` processes of ``script`` as ranks of one gloo job, each in its own process group.

    Output goes to a pipe, or with ``output_dir`` to ``rank-<R>.out`` files there: a supervisor that polls
    instead of reading could otherwise block a chatty rank on a full pipe.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = base_env(env)
        rank_env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        with contextlib.ExitStack() as files:
            sink: int | IO[str] = subprocess.PIPE
            if output_dir is not None:
                sink = files.enter_context(open(output_dir / f"rank-{rank}.out", "w"))  # the child keeps a copy
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env=rank_env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
    return procs


def run_ranks(
    script: str | Path,
    args: Sequence[str],
    world_size: int,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run ``world_size`` ranks of ``script`` and wait for all of them.

    On timeout every rank is killed and the test fails with each rank's output, so a hang is never silent. The
    port :func:`free_port` found can be taken by another process before rank 0 listens on it (tests run in
    parallel): then the ranks are started again on another port, at most twice.
    """
    for _ in range(2):
        results = _run_ranks_once(script, args, world_size, timeout, env)
        if not any(r.returncode != 0 and PORT_TAKEN in r.output for r in results):
            return results
    return _run_ranks_once(script, args, world_size, timeout, env)


PORT_TAKEN = "EADDRINUSE"  # what rank 0's TCPStore says when its port was taken


def _run_ranks_once(
    script: str | Path, args: Sequence[str], world_size: int, timeout: float, env: dict[str, str] | None
) -> list[RankResult]:
    procs = start_ranks(script, args, world_size, env=env)
    deadline = time.monotonic() + timeout
    results = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    kill_tree(other)
                outputs = "\n".join(f"--- rank {r}:\n{p.communicate()[0]}" for r, p in enumerate(procs))
                raise AssertionError(f"ranks did not finish within {timeout}s\n{outputs}") from None
            results.append(RankResult(rank, proc.returncode, out))
            if proc.returncode != 0 and PORT_TAKEN in out:  # the others wait for a store that never came up
                return results
    finally:
        for proc in procs:
            kill_tree(proc)
    return results


def check_ranks(results: list[RankResult]) -> list[RankResult]:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        text = "\n".join(f"--- rank {r.rank} exited {r.returncode}:\n{r.output[-6000:]}" for r in results)
        raise AssertionError(f"{len(bad)} rank(s) failed\n{text}")
    return results


def kill_tree(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def kill_job(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a launcher and every worker: torchelastic starts each worker in a session of its own."""
    import psutil

    try:
        family = [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    kill_tree(proc)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def accelerate_launch(script: Path, *args: str, flags: Sequence[str] = ()) -> list[str]:
    """The command of a 2-process ``accelerate launch --multi_gpu`` job on this host (CPU ranks: the scripts make
    ``Accelerator(cpu=True)``), on a free port."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu"]
    command += ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*command, "--main_process_port", str(free_port()), *flags, str(script), *args]


def elastic_node(
    port: int, node: int, rdzv_id: str, nproc: int, script: Path, *args: str, static: bool = False
) -> list[str]:
    """The command of node ``node``'s torchrun agent in a 2-node job on this host, with one restart: a c10d
    rendezvous on ``127.0.0.1:port`` hosted by node 0 (a lost node leaves it 8 s after its last heartbeat, not the
    default 15 s; live ones beat every 1-2 s), or with ``static`` the static one, as ``srun torchrun --node_rank``."""
    if static:
        rendezvous = ["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    else:
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", rdzv_id]
        rendezvous += ["--rdzv_conf", f"is_host={int(node == 0)},keep_alive_interval=1,keep_alive_max_attempt=8"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(nproc)]
    return [*command, *rendezvous, "--max_restarts", "1", str(script), *args]


class MotoServer:
    """moto's S3 server as its own process on 127.0.0.1, so a test can also kill it mid-upload."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> MotoServer:
        import requests

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                requests.get(f"{self.endpoint}/moto-api/", timeout=1)
                return self
            except requests.RequestException:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto server did not start within 30 s")

    def reset(self) -> None:
        import requests

        requests.post(f"{self.endpoint}/moto-api/reset", timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc)
            self.proc.wait()
            self.proc = None


def edit_manifest(step_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a committed manifest in place, as a bug or someone with write access to the storage could."""
    path = step_dir / "manifest.json"
    body = json.loads(path.read_bytes())
    edit(body)
    path.write_text(json.dumps(body))


def reseal(step_dir: Path, name: str) -> None:
    """Make the manifest's size and checksum of ``name`` match its bytes now: a tamperer covering their tracks."""
    from resilience.storage.manifest import hash_bytes

    data = (step_dir / name).read_bytes()

    def match(body: dict[str, Any]) -> None:
        entry = next(f for f in body["files"] if f["path"] == name)
        entry["size"], entry["xxh3_64"] = len(data), hash_bytes(data)

    edit_manifest(step_dir, match)


def record_tier_opens(reads: list[tuple[str, str]], patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make every read of a checkpoint's files but its manifest note the file, with where it was read, in
    ``reads``: a tier's ``open`` and ``read_bytes`` (by tier name; a local copy is checked, then read), and a
    peer's memory (``"peer"``). ``patch``: ``monkeypatch.setattr`` in a test, plain ``setattr`` in a worker."""
    from resilience.storage.layout import MANIFEST
    from resilience.storage.peer_copies import PeerCopies
    from resilience.storage.tiers import LocalTier, Tier

    def note(where: str, path: str) -> None:
        if "/step-" in path and os.path.basename(path) != MANIFEST:
            reads.append((where, os.path.basename(path)))

    for cls in (Tier, LocalTier):  # the local tier has an open of its own (it reads past the page cache)
        original = cls.__dict__["open"]

        def opened(self: Tier, path: str, mode: str = "rb", *, _original: Any = original) -> IO[bytes]:
            stream = _original(self, path, mode)  # only files that are there
            if mode == "rb":
                note(self.name, path)
            return stream

        patch(cls, "open", opened)
    read_bytes = Tier.read_bytes

    def read_whole(self: Tier, path: str) -> bytes:
        data = read_bytes(self, path)
        note(self.name, path)
        return data

    fetch = PeerCopies.fetch

    def fetched(self: PeerCopies, name: str) -> IO[bytes] | None:
        stream = fetch(self, name)
        if stream is not None:
            note("peer", f"/step-{self.step}/{name}")
        return stream

    patch(Tier, "read_bytes", read_whole)
    patch(PeerCopies, "fetch", fetched)


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class _Fault:
    kind: str
    method: str
    match: str
    times: int
    delay_s: float


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint that misbehaves on chosen requests.

    Object stores fail in ways a local moto server never does on its own: error and throttling responses,
    slow or lost responses, an endpoint that goes away and comes back. The proxy forwards everything to the
    real server except the next ``times`` requests that match a fault, and it can stop listening (connection
    refused) and start again on the same port while the server behind it keeps its state.

    Faults: ``"500"`` (InternalError), ``"503"`` (SlowDown, S3's throttling), ``"drop"`` (the connection closes
    without a response), ``"slow"`` (wait ``delay_s`` before forwarding), ``"late"`` (forward, then wait
    ``delay_s`` before answering: the request takes effect but its response may be lost to a client timeout).
    """

    _ERRORS = {
        "500": (500, "InternalError", "We encountered an internal error. Please try again."),
        "503": (503, "SlowDown", "Please reduce your request rate."),
    }

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._requests: list[tuple[str, str, str]] = []  # method, path, what happened
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def inject(self, kind: str, *, method: str = "PUT", match: str = "", times: int = 1, delay_s: float = 0.0) -> None:
        """Misbehave on the next ``times`` requests with ``method`` whose path contains ``match``."""
        if kind not in (*self._ERRORS, "drop", "slow", "late"):
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._faults.append(_Fault(kind, method, match, times, delay_s))

    def injected(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return [r for r in self._requests if r[2] != "forwarded"]

    def _take(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.times > 0 and fault.method == method and fault.match in path:
                    fault.times -= 1
                    self._requests.append((method, path, fault.kind))
                    return fault
            self._requests.append((method, path, "forwarded"))
            return None

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                proxy._serve(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening: new connections are refused, as by a server that went away."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        body = _read_body(handler)
        fault = self._take(handler.command, handler.path)
        handler.close_connection = True  # every request on a fresh connection, so stop() cuts off everyone
        if fault is not None and fault.kind == "drop":
            return
        if fault is not None and fault.kind in self._ERRORS:
            status, code, message = self._ERRORS[fault.kind]
            payload = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
            handler.send_response(status)
            handler.send_header("Content-Type", "application/xml")
            handler.send_header("Content-Length", str(len(payload)))
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.wfile.write(payload)
            return
        if fault is not None and fault.kind == "slow":
            time.sleep(fault.delay_s)
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or handler.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(handler.command, handler.path, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            if fault is not None and fault.kind == "late":
                time.sleep(fault.delay_s)
            handler.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in _HOP_BY_HOP and (handler.command == "HEAD" or name.lower() != "content-length"):
                    handler.send_header(name, value)
            if handler.command != "HEAD":
                handler.send_header("Content-Length", str(len(payload)))
            handler.send_header("Connection", "close")
            handler.end_headers()
            if handler.command != "HEAD":
                handler.wfile.write(payload)
        except OSError:
            pass  # the client gave up (timeout) or the upstream is gone: nothing left to answer
        finally:
            conn.close()


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""
