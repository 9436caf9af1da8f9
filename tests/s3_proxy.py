"""An HTTP proxy on 127.0.0.1 in front of an S3 endpoint (moto) that misbehaves the way object stores do.

Object stores fail in ways a local moto server never does on its own: error and throttling responses, slow or
lost responses, an endpoint that goes away and comes back, a gateway that takes connections and never answers.
The proxy forwards every request to the real server, except:

- one-off faults (:meth:`FaultProxy.inject`): the next ``times`` requests that match misbehave;
- a standing mode, switched at any time from the test: :meth:`FaultProxy.throttle` answers a fraction of the
  PUTs with ``503 SlowDown``, :meth:`FaultProxy.hang` accepts connections and never answers them, and
  :meth:`FaultProxy.passthrough` forwards everything again (the held connections are then closed unanswered);
- :meth:`FaultProxy.stop`: nothing listens (connection refused); :meth:`FaultProxy.start` listens again on the
  same port, while the server behind keeps its state.

Every request is served on a fresh connection, so a mode switch or a stop reaches every client at once.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.helpers import free_port

_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


@dataclass
class _Fault:
    kind: str
    method: str
    match: str
    times: int
    delay_s: float


@dataclass
class _Throttle:
    fraction: float
    method: str
    match: str
    draw: random.Random

    def hit(self) -> bool:
        """Whether this request is throttled (a draw per matching request)."""
        return self.draw.random() < self.fraction


class FaultProxy:
    """The proxy; see the module. One-off faults: ``"500"`` (InternalError), ``"503"`` (SlowDown, S3's
    throttling), ``"drop"`` (the connection closes without a response), ``"slow"`` (wait ``delay_s`` before
    forwarding), ``"late"`` (forward, then wait ``delay_s`` before answering: the request takes effect but its
    response may be lost to a client timeout)."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._requests: list[tuple[str, str, str]] = []  # method, path, what happened
        self._faults: list[_Fault] = []
        self._throttle: _Throttle | None = None
        self._released = threading.Event()  # set while not hanging: held connections go
        self._released.set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ---- what to do ----------------------------------------------------------------------------------------

    def inject(self, kind: str, *, method: str = "PUT", match: str = "", times: int = 1, delay_s: float = 0.0) -> None:
        """Misbehave on the next ``times`` requests with ``method`` whose path contains ``match``."""
        if kind not in (*_ERRORS, "drop", "slow", "late"):
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._faults.append(_Fault(kind, method, match, times, delay_s))

    def throttle(self, fraction: float, *, method: str = "PUT", match: str = "", seed: int = 0) -> None:
        """From now on, answer about ``fraction`` of the requests with ``method`` whose path contains ``match``
        with ``503 SlowDown`` (drawn from a generator seeded with ``seed``); the rest are forwarded."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction={fraction}: give a share between 0 and 1")
        with self._lock:
            self._throttle = _Throttle(fraction, method, match, random.Random(seed))

    def hang(self) -> None:
        """From now on, accept connections and never answer them (a hung gateway), until :meth:`passthrough`
        or :meth:`stop`."""
        self._released.clear()

    def passthrough(self) -> None:
        """Forward everything again: no throttling, and the connections held by :meth:`hang` are closed."""
        with self._lock:
            self._throttle = None
        self._released.set()

    # ---- what happened -----------------------------------------------------------------------------------

    def injected(self) -> list[tuple[str, str, str]]:
        """(method, path, kind) of every request not simply forwarded, in order: a fault's kind, ``"503"`` for
        a throttled one, ``"hang"`` for a connection held unanswered (its method and path never read)."""
        with self._lock:
            return [r for r in self._requests if r[2] != "forwarded"]

    def count(self, kind: str) -> int:
        """How many requests got ``kind`` (see :meth:`injected`; ``"forwarded"`` for the others)."""
        with self._lock:
            return sum(1 for r in self._requests if r[2] == kind)

    # ---- listening ---------------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def handle(self) -> None:
                if not proxy._hold():
                    super().handle()

            def do_GET(self) -> None:
                proxy._serve(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening: new connections are refused, as by a server that went away; held ones are closed."""
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- serving -----------------------------------------------------------------------------------------

    def _hold(self) -> bool:
        """While hanging: keep a new connection open, unread and unanswered, until released; then True."""
        if self._released.is_set():
            return False
        with self._lock:
            self._requests.append(("", "", "hang"))
        self._released.wait()
        return True

    def _take(self, method: str, path: str) -> _Fault | None:
        """The one-off fault or standing throttle this request meets, recorded; None to forward it."""
        with self._lock:
            for fault in self._faults:
                if fault.times > 0 and fault.method == method and fault.match in path:
                    fault.times -= 1
                    self._requests.append((method, path, fault.kind))
                    return fault
            throttle = self._throttle
            if throttle is not None and throttle.method == method and throttle.match in path and throttle.hit():
                self._requests.append((method, path, "503"))
                return _Fault("503", method, path, 0, 0.0)
            self._requests.append((method, path, "forwarded"))
            return None

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        body = _read_body(handler)
        fault = self._take(handler.command, handler.path)
        handler.close_connection = True  # every request on a fresh connection, so stop() cuts off everyone
        if fault is not None and fault.kind == "drop":
            return
        if fault is not None and fault.kind in _ERRORS:
            _answer_error(handler, fault.kind)
            return
        if fault is not None and fault.kind == "slow":
            time.sleep(fault.delay_s)
        self._forward(handler, body, fault.delay_s if fault is not None and fault.kind == "late" else 0.0)

    def _forward(self, handler: BaseHTTPRequestHandler, body: bytes, late_s: float) -> None:
        """Send the request upstream and its answer back (``late_s`` after it came)."""
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or handler.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(handler.command, handler.path, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            time.sleep(late_s)
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


def _answer_error(handler: BaseHTTPRequestHandler, kind: str) -> None:
    status, code, message = _ERRORS[kind]
    payload = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(payload)))
    handler.send_header("Connection", "close")
    handler.end_headers()
    handler.wfile.write(payload)


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
