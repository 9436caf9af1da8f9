"""The persist path in a helper process: DCP write, checksums, commit, upload and retention off the training
process.

The training process only copies the state into shared-memory buffers; one long-lived helper process per rank
reads them in place and runs the same pipeline (:class:`~resilience.persist.pipeline.Pipeline`) that would otherwise
run as threads of the training process. Serialisation, hashing and file I/O in Python compete with the
training thread for the interpreter lock and stall it (on GPU nodes that thread launches the kernels): in a
process of their own they only compete for a core. The helpers of all ranks form a gloo group of their own,
through a TCP store that rank 0's training process hosts, so the commit protocol is unchanged: every rank's
helper writes its files, the helpers agree, the local leader's helper writes the manifest.

Modules named in ``RESILIENCE_HELPER_PRELOAD`` (comma-separated) are imported by every helper as it starts: the
way to instrument the persist path (a tracer, a profiler, a fault drill), which no longer runs in the training
process. They find the training process's pid in ``RESILIENCE_HELPER_PARENT_PID``.

Helpers are forked by a small server process of ours that has imported torch and the engine once, so a helper
starts in milliseconds, not the seconds an interpreter with torch takes. (multiprocessing's own forkserver would
import the user's training script again in every helper, running any of its top-level code a second time.) The
staging buffers are named shared-memory segments the helper maps by name. A helper that dies fails the saves it
held (nothing half-written is ever committed: the manifest comes last, after every helper agreed); the next save
says so, and restarts every rank's helper or stops training, as configured.

Schedulers stop a job by signalling every process of it: SLURM each process of the job step, torchrun and
``accelerate launch`` each worker's process group, Kubernetes the whole container at the end of its grace, and a
terminal's Ctrl-C the foreground process group. The helpers hold the very saves the training process makes when
it is told to stop, so they ignore those signals (:data:`STOP_SIGNALS`, from before their interpreter starts) and
end with their training process instead: a helper exits when its connection closes, the fork server when its
keep-alive pipe does, and a SIGKILL at the end of the grace ends them all.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch
import torch.distributed as dist

from resilience.checkpoint.events import Events
from resilience.checkpoint.save_handle import Commit, SaveHandle
from resilience.checkpoint.staging import SegmentRef, StagingJob, attach, segment_of
from resilience.config import CheckpointConfig
from resilience.dist import Topology
from resilience.errors import CheckpointError, describe
from resilience.health.signals import STOP_SIGNALS
from resilience.persist.worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HelperSettings:
    """What a helper needs to run its part of the pipeline; sent once, at start."""

    config: CheckpointConfig
    topology: Topology
    local_shared: bool
    store_host: str
    store_port: int
    generation: int
    log_level: int
    preload: tuple[str, ...] = ()
    environ: dict[str, str] = field(default_factory=dict)  # the training process's, as of this helper's start
    parent_pid: int = 0


# What a client sends the fork server first: which kind of helper it connects to.
_PIPELINE, _CALL = b"pipeline", b"call"


@dataclass(frozen=True)
class Call:
    """One function to run in a helper forked for it: a module-level function with picklable arguments, run
    with the training process's environment, log level and preloads as of the call."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    log_level: int
    preload: tuple[str, ...]
    environ: dict[str, str]
    parent_pid: int


@dataclass(frozen=True)
class Piece:
    """A DTensor's local shard where there is no device mesh (the helper): its DCP write items were made by the
    training process from the real DTensor, so the global layout is kept and loads reshard as usual."""

    local: torch.Tensor
    items: list[Any]

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        return self.items


@dataclass
class WriteSpec:
    """One save, as the helper gets it: which buffers hold this rank's share, and everything but tensors."""

    step: int
    keys: list[str]
    pieces: dict[str, list[Any]]
    skeleton: Any
    rank_skeleton: Any
    pickled: list[str]
    extra: dict[str, Any]
    block_s: float
    run_id: str | None
    writer: dict[str, Any] | None
    protected: list[int] = field(default_factory=list)
    record_crcs: bool = False


CONNECT_TIMEOUT_S = 120.0  # for the fork server to start, the first time (an interpreter importing torch)


class ForkServer:
    """One per training process: a child interpreter with the engine imported, forking a helper per request.

    It listens on a Unix socket in a private temporary folder; each accepted connection becomes the
    connection between the training process and the helper forked for it. It exits with the training process
    (it watches a pipe only the training process holds open).
    """

    _instance: ForkServer | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="resilience-helpers-")
        self.address = os.path.join(self.folder, "socket")
        self.authkey = os.urandom(16)
        read, self._keepalive = os.pipe()
        env = {**os.environ, "RESILIENCE_HELPER_AUTHKEY": self.authkey.hex()}
        # Blocked in this thread while the server is started: the child inherits the mask across exec, so a stop
        # signal that comes while its interpreter imports torch waits, and is ignored once the server is up
        # (_ignore_stop_signals). This thread gets it again after the start, or another thread takes it meanwhile.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "resilience.persist.helper", self.address, str(read)],
                pass_fds=(read,),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read)
        self.wanted = False  # by more than start_server_early(): a helper was or is being forked from it

    @classmethod
    def get(cls, *, early: bool = False) -> ForkServer:
        with cls._guard:
            if cls._instance is None or cls._instance.process.poll() is not None:
                cls._instance = cls()
            cls._instance.wanted |= not early
            return cls._instance

    def stop(self) -> None:
        """End the server at once, while it has forked nothing (it may still be importing torch)."""
        self.process.kill()
        self.process.wait()
        os.close(self._keepalive)
        shutil.rmtree(self.folder, ignore_errors=True)

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
        """A connection to a newly forked helper (waits for the server to be up, the first time)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return Client(self.address, family="AF_UNIX", authkey=self.authkey)
            except (FileNotFoundError, ConnectionRefusedError):
                if self.process.poll() is not None:
                    raise CheckpointError(
                        f"the checkpoint helper server exited with code {self.process.returncode} before it "
                        "started; see its output above, or set persist='thread'"
                    ) from None
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"the checkpoint helper server did not start within {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.02)


def start_server_early() -> None:
    """Start this process's fork server now, when the settings are made: its interpreter takes seconds to import
    torch, and the first save would wait for it, stalling training where a name is written at once (which waits
    for its commit). By the first save, seconds later (the framework's set-up, a resume), it is up."""
    ForkServer.get(early=True)


def stop_early_server() -> None:
    """Stop the fork server :func:`start_server_early` started if nothing has wanted a helper from it since: the
    engine persists in threads after all (``persist="auto"`` and a small model), and the server's interpreter
    would go on importing torch for a second or two on the cores training uses."""
    with ForkServer._guard:
        server = ForkServer._instance
        if server is None or server.wanted:
            return
        ForkServer._instance = None
    server.stop()


class HelperPipeline:
    """The training process's side: the same interface as :class:`~resilience.persist.pipeline.Pipeline`.

    Args:
        settings: For the helper (config, topology, the helpers' store).
        events: The manager's events; the helper's are passed on to them.
        committed: Called with a step once committed locally.
        protected_steps: Steps retention must keep, sent with every save.
    """

    def __init__(
        self,
        settings: HelperSettings,
        events: Events,
        committed: Any,
        protected_steps: Any,
    ):
        self.settings = settings
        self.events = events
        self._on_committed = committed
        self._protected_steps = protected_steps
        self.errors: list[CheckpointError] = []
        self.died: str | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # also orders a kill with the connection: see kill()
        self._killed = False
        self._handles: dict[int, SaveHandle] = {}
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

    # ---- the Pipeline interface ------------------------------------------------------------------------------

    def submit(self, job: Any) -> None:
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

    def discard_error(self, error: BaseException) -> None:
        with self._lock:
            self.errors = [e for e in self.errors if e is not error]

    def take_errors(self) -> list[CheckpointError]:
        with self._lock:
            errors, self.errors = self.errors, []
        return errors

    # ---- sending -----------------------------------------------------------------------------------------------

    def _send_next(self, queue: list[Any]) -> None:
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
        spec = WriteSpec(
            step=job.step,
            keys=list(staged),
            pieces=job.pieces,
            skeleton=job.skeleton,
            rank_skeleton=job.rank_skeleton,
            pickled=job.pickled,
            extra=job.extra,
            block_s=job.block_s,
            run_id=job.run_id,
            writer=job.writer,
            protected=sorted(self._protected_steps()),
            record_crcs=job.record_crcs,
        )
        try:
            if fresh:
                self._send(("buffers", fresh))
                self._sent_buffers.update(fresh)
            self._send(("write", spec))
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
            conn = ForkServer.get().connect(CONNECT_TIMEOUT_S)
            conn.send_bytes(_PIPELINE)
            conn.send(self.settings)
            kind, pid = conn.recv()
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
        if conn is None:
            return
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
                with self._lock:
                    self.errors.append(_unpickled(message[1]))
            elif kind in ("committed", "durable"):
                self._resolve(kind, message[1], message[2], message[3])
            elif kind == "closed":
                self._closed.set()
        if not self._closed.is_set():
            self._helper_died(f"the checkpoint helper process (pid {self.pid}) died")

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
            error = _unpickled(result)
            with self._lock:  # the same object as the one recorded, so raising it once also clears it
                error = next((e for e in self.errors if str(e) == str(error)), error)
            future.set_exception(error)
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
            with self._lock:
                self.errors.append(error)
            handle.fail(error)


def _local(tensor: Any) -> torch.Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def _fields(record: dict[str, Any]) -> dict[str, Any]:
    """A helper's event for this process's listeners: its time stays the time it happened in the helper."""
    return {k: v for k, v in record.items() if k not in ("event", "step", "rank")}


def _pickled(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:
        return pickle.dumps(CheckpointError(describe(exc)))


def _unpickled(data: bytes) -> CheckpointError:
    exc = pickle.loads(data)
    return exc if isinstance(exc, CheckpointError) else CheckpointError(describe(exc))


def call_in_helper(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` run in a helper process forked for this call, off the training process;
    its result, or its exception raised here. Blocks the calling thread (not the interpreter lock) until then.
    A helper that dies first raises :class:`CheckpointError`: whatever the function writes must therefore be
    whole or absent when it is cut short (as :func:`resilience.formats.export.atomic_output` makes a file)."""
    conn = ForkServer.get().connect()
    try:
        conn.send_bytes(_CALL)
        conn.send(Call(function, args, kwargs, helper_log_level(), helper_preload(), dict(os.environ), os.getpid()))
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            target = getattr(function, "func", function)  # a functools.partial names its function
            raise CheckpointError(
                f"the helper process running {target.__module__}.{target.__qualname__} died before it finished"
            ) from None
    finally:
        conn.close()
    if kind == "error":
        data, text = payload
        try:
            error = pickle.loads(data)
        except Exception:  # an exception type whose arguments do not survive pickling
            error = CheckpointError(text)
        raise error
    return payload


# ---- the helper process ------------------------------------------------------------------------------------------


def _ignore_stop_signals() -> None:
    """The server and every helper forked from it ignore :data:`STOP_SIGNALS` (dispositions survive a fork):
    a stop of the job must not cut short the saves they hold. Blocked since the server's start, the ones that
    came meanwhile are dropped as they are unblocked."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _serve(address: str, keepalive_fd: int) -> None:
    """The fork server: fork a helper for every connection, until the training process goes away."""
    import selectors

    _ignore_stop_signals()
    warmed = False
    listener = Listener(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("RESILIENCE_HELPER_AUTHKEY")))
    selector = selectors.DefaultSelector()
    selector.register(listener._listener._socket, selectors.EVENT_READ, "accept")  # type: ignore[attr-defined]
    selector.register(keepalive_fd, selectors.EVENT_READ, "parent")
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    while True:
        for key, _ in selector.select():
            if key.data == "parent":  # EOF: the training process is gone; its helpers see it themselves
                listener.close()
                shutil.rmtree(os.path.dirname(address), ignore_errors=True)  # the socket's private folder
                return
            conn = listener.accept()
            try:
                kind = conn.recv_bytes(16)  # sent first by both clients, before what the helper reads
            except (EOFError, OSError):
                conn.close()
                continue
            if kind == _CALL and not warmed:
                _import_once_for_all_helpers()
                warmed = True
            if os.fork() == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                listener.close()
                if kind == _CALL:
                    _exit_with_training_process(keepalive_fd)
                else:  # a persist helper reads its connection all the time: its EOF says the same
                    os.close(keepalive_fd)
                try:
                    first = conn.recv()
                    if isinstance(first, Call):
                        _call_main(conn, first)
                    else:
                        _helper_main(conn, first)
                finally:
                    os._exit(0)
            conn.close()  # the child holds it now: its death is an EOF the training process sees


def _import_once_for_all_helpers() -> None:
    """Import in the server, at its first :class:`Call`, what a helper forked for a call would otherwise import
    again every time: a name's writer makes placeholder tensors, and torch's fake-tensor mode imports
    ``torch._dynamo`` the first time one is made (0.5-0.9 s of CPU on a 2-core VM, out of a 1.6 GB name's
    2.5 s). Not at the server's start: most processes never write a name, and would pay it at every launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode()


def _exit_with_training_process(keepalive_fd: int) -> None:
    """A helper forked for a call exits as soon as its training process is gone, mid-call or not, as the
    training process's own threads would. What it writes is whole or absent either way; and a name an orphan
    went on writing could land after a relaunch wrote the same path anew (``last.ckpt`` back to an older
    step). The relaunch writes again what was cut short (:meth:`~resilience.formats.names.NameWriter.repair`)."""

    def watch() -> None:
        while os.read(keepalive_fd, 64):  # nothing is ever written: this returns b"" when the writer is gone
            pass
        os._exit(1)

    threading.Thread(target=watch, name="resilience-parent-watch", daemon=True).start()


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _become(environ: dict[str, str], parent_pid: int, log_level: int, preload: tuple[str, ...]) -> None:
    """A forked helper takes on its training process's settings."""
    os.environ.clear()  # the fork server's is from when it started; credentials and settings may have changed
    os.environ.update(environ, RESILIENCE_HELPER_PARENT_PID=str(parent_pid))
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    for module in preload:  # instrumentation of the helper: tracing, profiling, fault drills
        importlib.import_module(module)


def _call_main(conn: Connection, call: Call) -> None:
    """Run one :class:`Call` and send back its result or its exception."""
    _become(call.environ, call.parent_pid, call.log_level, call.preload)
    try:
        result = ("ok", call.function(*call.args, **call.kwargs))
    except BaseException as exc:
        result = ("error", (_pickled(exc), describe(exc)))
    conn.send(result)


def _helper_main(conn: Connection, settings: HelperSettings) -> None:
    """Run this rank's part of the pipeline on what the training process sends, until told to close."""
    from resilience.dist import Groups
    from resilience.persist.pipeline import Pipeline, WriteJob
    from resilience.storage.tiers import DurableTier, LocalTier

    _become(settings.environ, settings.parent_pid, settings.log_level, settings.preload)
    config, topology = settings.config, settings.topology
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    send(("ready", os.getpid()))
    if topology.world_size > 1:
        timeout = timedelta(seconds=config.collective_timeout_s)
        store = dist.TCPStore(settings.store_host, settings.store_port, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"resilience-helpers/{settings.generation}", store)
        dist.init_process_group(
            "gloo", store=prefixed, rank=topology.rank, world_size=topology.world_size, timeout=timeout
        )
    groups = Groups(config.collective_timeout_s, topology.nodes[topology.rank])
    protected: set[int] = set()
    events = Events(topology.rank, [lambda record: send(("event", record))])
    pipeline = Pipeline(
        config,
        LocalTier(config.local_root),
        DurableTier(config.durable_url, config.storage_options) if config.durable_url else None,
        topology,
        groups.writer,
        groups.upload,
        settings.local_shared,
        events,
        lambda step: send(("known", step)),
        lambda: set(protected),
        on_error=lambda error: send(("error", _pickled(error))),
    )
    buffers: dict[str, torch.Tensor] = {}
    mapped: dict[str, torch.Tensor] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the training process is gone: nothing more will come
        kind = message[0]
        if kind == "buffers":
            for key, ref in message[1].items():  # the training process's staging buffers, read in place
                buffers[key] = attach(ref, mapped)
        elif kind == "write":
            spec: WriteSpec = message[1]
            protected = set(spec.protected)
            handle = SaveHandle(spec.step)
            handle.committed.add_done_callback(_forward("committed", spec.step, handle, send))
            handle.durable.add_done_callback(_forward("durable", spec.step, handle, send))
            staged = {k: Piece(buffers[k], spec.pieces[k]) if k in spec.pieces else buffers[k] for k in spec.keys}
            pipeline.submit(
                WriteJob(
                    step=spec.step,
                    staging=StagingJob(staged),  # type: ignore[arg-type]
                    skeleton=spec.skeleton,
                    rank_skeleton=spec.rank_skeleton,
                    pickled=spec.pickled,
                    extra=spec.extra,
                    handle=handle,
                    block_s=spec.block_s,
                    run_id=spec.run_id,
                    writer=spec.writer,
                    record_crcs=spec.record_crcs,
                )
            )
        elif kind == "retain":
            protected = set(message[1])
            pipeline.close()
            pipeline.retain()
        elif kind == "close":
            pipeline.close()
            send(("closed",))
            return


def _forward(kind: str, step: int, handle: SaveHandle, send: Any) -> Any:
    def done(future: Any) -> None:
        error = future.exception()
        result: Commit | bytes | None = _pickled(error) if error is not None else future.result()
        send((kind, step, result, dict(handle.timings)))

    return done


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


if __name__ == "__main__":
    # The imported module's server, not this ``__main__`` copy's: what the training process sends is pickled
    # as resilience.persist.helper's classes, and the server tells a Call from HelperSettings by class.
    import resilience.persist.helper

    resilience.persist.helper._serve(sys.argv[1], int(sys.argv[2]))
    # Its training process is gone. The interpreter's teardown would collect a heap with torch in it (0.4 s of
    # CPU here) while the server still holds the training process's stdout and stderr: whoever reads them to
    # the end (`| tee`, a CI runner, subprocess.run(capture_output=True)) would wait for it. Nothing of the
    # server's needs that teardown; its helpers end on their own connections.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
