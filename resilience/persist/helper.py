"""The persist path in a helper process, as the training process sees it: DCP write, checksums, commit, upload and
retention off the training process.

The training process only copies the state into shared-memory buffers; one long-lived helper process per rank
reads them in place and runs the same pipeline (:class:`~resilience.persist.pipeline.Pipeline`) that would otherwise
run as threads of the training process (:mod:`resilience.persist.helper_process`). Serialisation, hashing and file
I/O in Python compete with the training thread for the interpreter lock and stall it (on GPU nodes that thread
launches the kernels): in a process of their own they only compete for a core. The helpers of all ranks form a
gloo group of their own, through a TCP store that rank 0's training process hosts, so the commit protocol is
unchanged: every rank's helper writes its files, the helpers agree, the local leader's helper writes the manifest.
A helper that dies fails the saves it held (nothing half-written is ever committed: the manifest comes last, after
every helper agreed); the next save says so, and restarts every rank's helper or stops training, as configured.

A rank's helper also runs functions the training process sends it (:meth:`HelperPipeline.call`: how rank 0 writes
framework-named files), beside its saves; :func:`call_in_helper` runs one in a helper forked for it, where the
rank has none. Helpers are forked by :mod:`resilience.persist.fork_server`, in milliseconds.

Modules named in ``RESILIENCE_HELPER_PRELOAD`` (comma-separated) are imported by every helper as it starts: the
way to instrument the persist path (a tracer, a profiler, a fault drill), which no longer runs in the training
process. They find the training process's pid in ``RESILIENCE_HELPER_PARENT_PID``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from resilience.checkpoint.save_events import SaveEvents
from resilience.checkpoint.save_handle import SaveHandle
from resilience.checkpoint.staging import SegmentRef, segment_of
from resilience.config import CheckpointConfig
from resilience.dist import Topology
from resilience.errors import CheckpointError, describe
from resilience.persist import Failures, PersistPipeline
from resilience.persist.fork_server import CONNECT_TIMEOUT_S, Call, ForkServer, Inherited, connect
from resilience.persist.helper_process import returned, unpickled_error
from resilience.persist.worker import Worker

if TYPE_CHECKING:
    from resilience.persist.pipeline import WriteJob

log = logging.getLogger(__name__)


class HelperGone(CheckpointError):
    """A call to a rank's helper got no answer: the helper was not there, or ended first."""


@dataclass(frozen=True, kw_only=True)
class HelperSettings(Inherited):
    """What a helper needs to run its part of the pipeline; sent once, at start."""

    config: CheckpointConfig
    topology: Topology
    local_shared: bool
    store_host: str
    store_port: int
    generation: int


class HelperPipeline(PersistPipeline):
    """The training process's side of a rank's helper process, which runs the pipeline there; unlike the threads
    of :class:`~resilience.persist.pipeline.Pipeline`, it can be killed, and says if it died.

    Args:
        settings: For the helper (config, topology, the helpers' store).
        events: The manager's events; the helper's are passed on to them.
        committed: Called with a step once committed locally.
        protected_steps: Steps retention must keep, sent with every save.
    """

    def __init__(
        self,
        settings: HelperSettings,
        events: SaveEvents,
        committed: Callable[[int], None],
        protected_steps: Callable[[], set[int]],
    ):
        self.settings = settings
        self.events = events
        self._on_committed = committed
        self._protected_steps = protected_steps
        self.failures = Failures()
        self.died: str | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # also orders a kill with the connection: see kill()
        self._killed = False
        self._handles: dict[int, SaveHandle] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._call_numbers = itertools.count()
        self._ended = False  # the reader has ended: no answer to a call comes any more
        self._sent_buffers: dict[str, SegmentRef] = {}
        self._closed = threading.Event()
        # The helper is connected in the background: the fork server's interpreter takes seconds to import torch,
        # and a resume, which reads in this process, must not wait for it. Sending waits until it is there.
        self.pid: int | None = None
        self._conn: Connection | None = None
        self._connected = threading.Event()
        ForkServer.get()  # starts it now, if not running
        self._sender = Worker("resilience-helper-send", self._send_next)
        self._reader = threading.Thread(target=self._read, name="resilience-helper-read", daemon=True)
        self._reader.start()

    # ---- the PersistPipeline interface -----------------------------------------------------------------------

    def submit(self, job: WriteJob) -> None:
        with self._lock:
            self._handles[job.step] = job.handle
            died = self.died
        if died is not None:
            self._fail(job.handle, CheckpointError(f"Not saved: {died}", step=job.step, tier="local"))
            return
        self._sender.put(job)

    def retain(self) -> None:
        with contextlib.suppress(OSError):  # no helper: its death is reported by the reader
            self._send(("retain", sorted(self._protected_steps())))

    def call(self, function: Callable[[], Any]) -> Any:
        """``function()`` (picklable) run in the helper, in a thread beside its saves, and waited for: its result,
        or its exception raised here. Raises :class:`HelperGone` if the helper is not there, or ends (dies, is
        killed, closes) before it answers: whether ``function`` ran, wholly or partly, is then unknown."""
        future: Future[Any] = Future()
        with self._lock:
            if self._ended or self.died is not None:
                raise HelperGone(f"the checkpoint helper process is gone ({self.died or 'closed'})")
            number = next(self._call_numbers)
            self._calls[number] = future
        try:
            self._send(("call", number, function))
        except OSError as exc:
            self._answered(number, HelperGone(f"the checkpoint helper process is not there ({exc})"))
        return future.result()

    def _answered(self, number: int, answer: Any) -> None:
        """Resolve call ``number`` with ``answer``: a :class:`HelperGone`, or what :func:`call_result` sent."""
        with self._lock:
            future = self._calls.pop(number, None)
        if future is None:
            return
        if isinstance(answer, HelperGone):
            future.set_exception(answer)
            return
        try:
            future.set_result(returned(*answer))
        except BaseException as exc:
            future.set_exception(exc)

    def close(self, timeout: float | None = None) -> bool:
        """Let the helper finish what it was given, then end it; False if it did not within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._sender.join(timeout):
            return False
        if self.died is None:
            with contextlib.suppress(OSError):
                self._send(("close",))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._reader.join(left)
        return not self._reader.is_alive()

    def kill(self) -> None:
        """End the helper now (its saves fail); for a restart after a helper of another rank died, or a survivor
        save. A helper still starting is not waited for (that can take seconds): it is ended as it connects,
        before it is sent any work."""
        with self._send_lock:
            self._killed = True
            pid = self.pid
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._reader.join(10.0)

    # ---- sending -----------------------------------------------------------------------------------------------

    def _send_next(self, queue: list[WriteJob]) -> None:
        with self._sender.cond:
            job = queue.pop(0)
        try:
            staged = job.staging.wait()  # the copy into shared memory is done: the helper may read it
        except BaseException as exc:
            self._fail(job.handle, CheckpointError(f"Staging failed: {describe(exc)}", step=job.step))
            return
        if not job.handle.staged.done():
            job.handle.staged.set_result(None)
        # by segment name, not address: a buffer made anew (another shape) may be mapped where the old one was
        segments = {k: segment_of(_local(t)) for k, t in staged.items()}
        fresh = {k: segment for k, segment in segments.items() if self._sent_buffers.get(k) != segment}
        try:
            if fresh:
                self._send(("buffers", fresh))
                self._sent_buffers.update(fresh)
            self._send(("write", job.spec(), list(staged), sorted(self._protected_steps())))
        except OSError:
            pass  # the reader sees the helper gone and fails the save

    def _send(self, message: tuple[Any, ...]) -> None:
        self._connected.wait(CONNECT_TIMEOUT_S)
        with self._send_lock:
            if self._conn is None or self._killed:
                raise OSError("no checkpoint helper process")
            self._conn.send(message)

    # ---- receiving ---------------------------------------------------------------------------------------------

    def _connect(self) -> Connection | None:
        try:
            conn = connect()
            conn.send(self.settings)
            kind, payload = conn.recv()
            pid = returned(kind, payload)  # else the error that kept it from starting, raised
            if kind != "ready":
                raise CheckpointError(f"the checkpoint helper answered {kind!r} instead of 'ready'")
            with self._send_lock:
                self.pid, self._conn, killed = pid, conn, self._killed
            if killed:  # ended while it started: it goes before anything was sent to it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        except Exception as exc:
            self._connected.set()
            self._helper_died(f"the checkpoint helper process could not be started: {describe(exc)}")
            return None
        self._connected.set()  # waiters see either a connection or, above, a death
        return conn

    def _read(self) -> None:
        conn = self._connect()
        if conn is not None:
            self._receive(conn)
        self._end_calls()

    def _receive(self, conn: Connection) -> None:
        """Pass on what the helper sends, until its connection ends; if it did not close, it died."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "event":
                self.events.emit(message[1]["event"], message[1]["step"], **_fields(message[1]))
            elif kind == "known":
                self._on_committed(message[1])
            elif kind == "error":
                self.failures.add(unpickled_error(message[1]))
            elif kind in ("committed", "durable"):
                self._resolve(kind, message[1], message[2], message[3])
            elif kind == "called":
                self._answered(message[1], message[2:])
            elif kind == "closed":
                self._closed.set()
        if not self._closed.is_set():
            ended = "was ended" if self._killed else "died"  # ended: for a survivor save or a restart
            self._helper_died(f"the checkpoint helper process (pid {self.pid}) {ended}")

    def _end_calls(self) -> None:
        """No answer comes any more: the calls still waiting for one fail, and later calls at once."""
        with self._lock:
            self._ended = True
            waiting = list(self._calls)
        why = self.died or "it closed"
        for number in waiting:
            self._answered(number, HelperGone(f"the checkpoint helper process ended before it answered ({why})"))

    def _resolve(self, kind: str, step: int, result: Any, timings: dict[str, float] | None) -> None:
        with self._lock:
            handle = self._handles.get(step)
        if handle is None:
            return
        future = handle.committed if kind == "committed" else handle.durable
        if timings:
            handle.timings.update(timings)
        if future.done():
            return
        if isinstance(result, bytes):
            future.set_exception(self.failures.kept_as(unpickled_error(result)))
        else:
            future.set_result(result)

    def _helper_died(self, why: str) -> None:
        # ended by kill() (a restart after a lost peer, a survivor save): expected, and said by whoever asked
        log.log(logging.INFO if self._killed else logging.ERROR, "%s; its unfinished saves are not committed", why)
        with self._lock:
            self.died = why
            handles = list(self._handles.values())
        for handle in handles:
            # committed before the helper died: saved, whether or not its next message (the durable phase) came
            committed = handle.committed.done() and handle.committed.exception() is None
            if committed and self.settings.config.durable_url is None:
                if not handle.durable.done():
                    handle.durable.set_result(None)  # what the helper sends next after such a commit
                continue
            what, tier = ("Not uploaded", "durable") if committed else ("Not saved", "local")
            self._fail(handle, CheckpointError(f"{what}: {why}", step=handle.step, tier=tier))

    def _fail(self, handle: SaveHandle, error: CheckpointError) -> None:
        if not (handle.committed.done() and handle.durable.done()):
            self.failures.add(error)
            handle.fail(error)


def _local(tensor: Any) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def _fields(record: dict[str, Any]) -> dict[str, Any]:
    """A helper's event for this process's listeners: its time stays the time it happened in the helper."""
    return {k: v for k, v in record.items() if k not in ("event", "step", "rank")}


def call_in_helper(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` run in a helper process forked for this call, off the training process;
    its result, or its exception raised here. Blocks the calling thread (not the interpreter lock) until then.
    A helper that dies first raises :class:`CheckpointError`: whatever the function writes must therefore be
    whole or absent when it is cut short (as :func:`resilience.formats.export.atomic_output` makes a file)."""
    conn = connect()
    try:
        environ, pid = dict(os.environ), os.getpid()
        conn.send(
            Call(
                function,
                args,
                kwargs,
                log_level=helper_log_level(),
                preload=helper_preload(),
                environ=environ,
                parent_pid=pid,
            )
        )
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            target = getattr(function, "func", function)  # a functools.partial names its function
            raise CheckpointError(
                f"the helper process running {target.__module__}.{target.__qualname__} died before it finished"
            ) from None
    finally:
        conn.close()
    return returned(kind, payload)


def helper_log_level() -> int:
    return logging.getLogger("resilience").getEffectiveLevel()


def helper_preload() -> tuple[str, ...]:
    return tuple(m.strip() for m in os.environ.get("RESILIENCE_HELPER_PRELOAD", "").split(",") if m.strip())


def start_store(topology: Topology, control: Any) -> tuple[str, int, Any]:
    """Rank 0's training process hosts the helpers' TCP store; every rank learns where (collective)."""
    store = None
    address: tuple[str, int] = ("", 0)
    if topology.world_size > 1 and topology.rank == 0:
        host = os.environ.get("MASTER_ADDR") or topology.host
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        address = (host, store.port)
    host, port = control.broadcast(address)
    return host, port, store
