"""Helper processes forked in milliseconds: a small server process of ours that has imported torch and the engine
once forks one per request, instead of the seconds an interpreter with torch takes to start. (multiprocessing's
own forkserver would import the user's training script again in every helper, running any of its top-level code
a second time.) A request is a connection; the helper forked for it keeps it as its line to the training process.
What it runs is told by the first message: a :class:`Call`, or a persist pipeline's settings
(:func:`~resilience.persist.helper_process.serve_pipeline`).

Schedulers stop a job by signalling every process of it: SLURM each process of the job step, torchrun and
``accelerate launch`` each worker's process group, Kubernetes the whole container at the end of its grace, and a
terminal's Ctrl-C the foreground process group. The helpers hold the very saves the training process makes when
it is told to stop, so they ignore those signals (:data:`STOP_SIGNALS`, from before their interpreter starts) and
end with their training process instead: a helper exits when its connection closes, the fork server when its
keep-alive pipe does, and a SIGKILL at the end of the grace ends them all.

The other ranks of a node use the first rank's server: those Lightning starts from that rank through their
environment (:func:`share_server`, :class:`InheritedServer`), those a launcher starts beside it (torchrun,
``accelerate launch``, ``resilience launch``) through a file (:class:`SiblingServer`). Each rank is a fresh
interpreter whose own server would import torch on the cores the ranks set up on, and be up only seconds after
its first save asked for a helper; one server is up sooner. A helper forked for another process takes that
process's settings, and ends with that process, not with the server's: a rank killed takes no other rank's
helper with it (a launcher's stop signal to its process group, where such helpers are, is ignored as above).
Should the shared server end first (its process did), the next helper comes from a server of the rank's own.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, TypeVar

import torch

from resilience.errors import CheckpointError, describe
from resilience.health.signals import STOP_SIGNALS
from resilience.persist import sibling_file
from resilience.persist.helper_process import call_result, error_result, serve_pipeline
from resilience.storage.processes import process_parent, process_start_ticks

OUTPUT = (1, 2)  # the file descriptors a helper writes to as its training process does: stdout and stderr

CONNECT_TIMEOUT_S = 120.0  # for the fork server to start, the first time (an interpreter importing torch)
# Where a process's fork server is, for the ranks it starts (share_server): JSON, see InheritedServer's fields.
SHARE_VARIABLE = "RESILIENCE_HELPER_SERVER"
# How long a rank waits, the first time, for the first rank of its node to publish its server (SiblingServer):
# the ranks make their plugins at about the same moment, and are in step at their first collective anyway.
SIBLING_WAIT_S = 3.0

Shared = TypeVar("Shared", bound="InheritedServer")


@dataclass(frozen=True, kw_only=True)
class Inherited:
    """What a forked helper takes on from its training process as of its request (the fork server's own are from
    its start, or another process's): environment, working directory (relative paths, such as a ``file://``
    durable URL, mean what they mean there), the CPUs it may run on (a launcher binds each rank to the cores near
    its GPU), pid, log level and the modules of ``RESILIENCE_HELPER_PRELOAD``; its stdout and stderr come with
    the connection (:func:`_dial`)."""

    log_level: int
    preload: tuple[str, ...] = ()
    environ: dict[str, str] = field(default_factory=dict)
    parent_pid: int = 0
    cwd: str = field(default_factory=os.getcwd)
    cpus: frozenset[int] = field(default_factory=lambda: frozenset(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class Call(Inherited):
    """One function to run in a helper forked for it: a module-level function with picklable arguments."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class ForkServer:
    """One per training process (and the processes it starts): a child interpreter with the engine imported,
    forking a helper per request.

    It listens on a Unix socket in a private temporary folder; each accepted connection becomes the
    connection between the training process and the helper forked for it. It exits with the training process
    that started it (it watches a pipe only that process holds open).
    """

    _instance: ForkServer | InheritedServer | None = None
    _guard = threading.Lock()
    _looked_for_sibling = False

    def __init__(self, published: str | None = None) -> None:
        """``published``: the file that tells this node's other ranks about it (:mod:`sibling_file`), if any."""
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
                [sys.executable, "-m", "resilience.persist.fork_server", self.address, str(read), published or ""],
                pass_fds=(read,),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read)
        self.wanted = False  # by more than start_server_early(): a helper was or is being forked from it
        owner, owner_start = os.getpid(), process_start_ticks(os.getpid()) or 0
        shared = InheritedServer(owner, self.process.pid, self.address, self.authkey.hex(), _code(), owner_start)
        self.share = json.dumps(asdict(shared))  # what share_server() tells the processes started, and siblings
        self.published = published
        if published is not None:
            with contextlib.suppress(OSError):  # the other ranks then start servers of their own, as without it
                sibling_file.publish(published, self.share)

    @classmethod
    def get(cls, *, early: bool = False) -> ForkServer | InheritedServer:
        """This process's server: the one it started, or the one of the process that started it, if running;
        else a new one."""
        with cls._guard:
            if cls._instance is None or not cls._instance.alive():
                cls._instance = InheritedServer.parse(os.environ.get(SHARE_VARIABLE)) or cls._of_node()
            cls._instance.wanted |= not early
            return cls._instance

    @classmethod
    def _of_node(cls) -> ForkServer | SiblingServer:
        """Under a launcher that starts every rank of a node (:func:`~sibling_file.sibling_path`), the first rank's
        server (published for the others; they wait for it a little, the first time), else one of this process's
        own."""
        path = sibling_file.sibling_path()
        if path is None:
            return cls()
        if sibling_file.first_sibling():
            return cls(published=path)
        wait_s = 0.0 if cls._looked_for_sibling else SIBLING_WAIT_S
        cls._looked_for_sibling = True
        return SiblingServer.find(path, wait_s) or cls()

    def stop(self) -> None:
        """End the server at once, while it has forked nothing (it may still be importing torch)."""
        if os.environ.get(SHARE_VARIABLE) == self.share:
            del os.environ[SHARE_VARIABLE]
        if self.published is not None:
            sibling_file.remove(self.published, self.address)
        self.process.kill()
        self.process.wait()
        os.close(self._keepalive)
        shutil.rmtree(self.folder, ignore_errors=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
        """A connection to a newly forked helper; waits for the server to be up, the first time."""
        deadline = time.monotonic() + timeout_s
        while (conn := _dial(self.address, self.authkey)) is None:
            if self.process.poll() is not None:
                raise CheckpointError(
                    f"the checkpoint helper server exited with code {self.process.returncode} before it "
                    "started; see its output above, or set persist='thread'"
                )
            _check_deadline(deadline, timeout_s)
            time.sleep(0.02)
        return conn


class ServerGone(Exception):
    """The inherited fork server has ended (with the process that started it)."""


@dataclass
class InheritedServer:
    """The fork server of the process that started this one (:func:`share_server`), used instead of a server of
    this process's own: it has imported torch already. Only a direct parent's (a pid that started this process
    cannot be another's), and only if it runs the same Python and the same engine code as this process."""

    owner: int  # the pid of the process that started the server
    pid: int  # the server's
    address: str
    authkey: str  # hex
    code: str  # the interpreter and the engine's folder (_code)
    owner_start: int = 0  # the owner's start time (process_start_ticks)
    wanted: bool = False

    @classmethod
    def parse(cls: type[Shared], text: str | None) -> Shared | None:
        """The server ``text`` describes (:attr:`ForkServer.share`), if it runs this process's code and is alive."""
        try:
            server = cls(**json.loads(text or "null"))
        except (TypeError, ValueError):
            return None
        return server if server.code == _code() and server.alive() else None

    def alive(self) -> bool:
        """While the parent that started the server runs (else this process has another parent now), and the
        server too (not a zombie its parent has not reaped yet)."""
        return os.getppid() == self.owner and process_start_ticks(self.pid) is not None

    def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
        """As :meth:`ForkServer.connect`; :class:`ServerGone` once the server has ended."""
        deadline = time.monotonic() + timeout_s
        while (conn := _dial(self.address, bytes.fromhex(self.authkey))) is None:
            if not self.alive():
                raise ServerGone
            _check_deadline(deadline, timeout_s)
            time.sleep(0.02)
        return conn

    def stop(self) -> None:
        """Nothing: the server is its owner's."""


@dataclass
class SiblingServer(InheritedServer):
    """The fork server of the first rank of this node, where a launcher started every rank of it
    (:mod:`~resilience.persist.sibling_file`). Only while the process that started it runs (the same process: its
    start time) and is a sibling of this one, and the server too."""

    @classmethod
    def find(cls, path: str, wait_s: float) -> SiblingServer | None:
        """The server published at ``path``, waiting up to ``wait_s`` for one to be."""
        deadline = time.monotonic() + wait_s
        while (server := cls.parse(sibling_file.read(path))) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return server

    def alive(self) -> bool:
        owner_runs = process_start_ticks(self.owner) == self.owner_start and process_parent(self.owner) == os.getppid()
        return owner_runs and process_start_ticks(self.pid) is not None


def connect(timeout_s: float = CONNECT_TIMEOUT_S) -> Connection:
    """A connection to a newly forked helper, from this process's fork server (started if need be); the first
    message sent on it says what the helper runs."""
    try:
        return ForkServer.get().connect(timeout_s)
    except ServerGone:  # the inherited server ended with its process: this one starts its own
        return ForkServer.get().connect(timeout_s)


def _code() -> str:
    """What a helper runs, as far as a process can tell: its Python and the engine's folder."""
    return f"{sys.executable}|{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}"


def _dial(address: str, authkey: bytes) -> Connection | None:
    """A connection to the server listening at ``address``, asking for a helper, which is handed this process's
    stdout and stderr (a launcher may give each rank files of its own); None while no server listens."""
    try:
        conn = Client(address, family="AF_UNIX", authkey=authkey)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno())) as sock:
            socket.send_fds(sock, [b"o"], [fd for fd in OUTPUT if _is_open(fd)])
    except BaseException:
        conn.close()
        raise
    return conn


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _check_deadline(deadline: float, timeout_s: float) -> None:
    if time.monotonic() > deadline:
        raise CheckpointError(f"the checkpoint helper server did not start within {timeout_s:.0f} s")


def start_server_early() -> None:
    """Start this process's fork server now, when the settings are made: its interpreter takes seconds to import
    torch, and the first save would wait for it, stalling training where a name is written at once (which waits
    for its commit). By the first save, seconds later (the framework's set-up, a resume), it is up."""
    ForkServer.get(early=True)


def share_server() -> None:
    """Start this process's fork server (as :func:`start_server_early`) for the processes it starts from now on,
    too: call before Lightning's launcher starts the other ranks of the node from this one. Their own servers would
    be up seconds after their first save asked for a helper; this one is up by then."""
    server = ForkServer.get(early=True)
    if isinstance(server, ForkServer):  # not one this process inherited: it started none of the ranks it serves
        os.environ[SHARE_VARIABLE] = server.share


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


# ---- the server process ------------------------------------------------------------------------------------------


def _ignore_stop_signals() -> None:
    """The server and every helper forked from it ignore :data:`STOP_SIGNALS` (dispositions survive a fork):
    a stop of the job must not cut short the saves they hold. Blocked since the server's start, the ones that
    came meanwhile are dropped as they are unblocked."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _serve(address: str, keepalive_fd: int, published: str) -> None:
    """The fork server: fork a helper for every connection, until the training process goes away; then it
    removes its socket's folder and the file that ``published`` it to its owner's sibling ranks, if any."""
    _ignore_stop_signals()
    listener = Listener(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("RESILIENCE_HELPER_AUTHKEY")))
    selector = selectors.DefaultSelector()
    selector.register(listener._listener._socket, selectors.EVENT_READ, "accept")  # type: ignore[attr-defined]
    selector.register(keepalive_fd, selectors.EVENT_READ, "parent")
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    gc.freeze()  # what the imports made: a helper's collections leave it alone, and the pages it shares with us
    while True:
        for key, _ in selector.select():
            if key.data == "parent":  # EOF: the training process is gone; its helpers see it themselves
                listener.close()
                shutil.rmtree(os.path.dirname(address), ignore_errors=True)  # the socket's private folder
                if published:
                    sibling_file.remove(published, address)
                return
            try:
                conn = listener.accept()
            except (OSError, EOFError, AuthenticationError):  # gone mid-handshake (a rank killed), or no key
                continue
            if os.fork() == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                listener.close()
                _helper(conn, keepalive_fd)
            conn.close()  # the child holds it now: its death is an EOF the training process sees


def _helper(conn: Connection, keepalive_fd: int) -> None:
    """A forked helper: it runs what its first message says, and exits."""
    os.close(keepalive_fd)  # the server's owner: a helper ends with its own training process, its connection's end
    try:
        _take_output(conn)
        first = conn.recv()
        try:
            _become(first)
        except Exception as exc:  # said to the training process, where its save or call raises it
            conn.send(error_result(exc))
            return
        if isinstance(first, Call):
            _exit_with_training_process(conn)
            _call_main(conn, first)
        else:
            serve_pipeline(conn, first)
    finally:
        os._exit(0)


def _take_output(conn: Connection) -> None:
    """Write where the training process writes (:func:`_dial`), not where the server's owner does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno())) as sock:
        received = socket.recv_fds(sock, 1, len(OUTPUT))[1]
    if len(received) == len(OUTPUT):  # else one of them was closed there: the server's stay
        for target, fd in zip(OUTPUT, received, strict=True):
            os.dup2(fd, target)
    for fd in received:
        os.close(fd)


def _exit_with_training_process(conn: Connection) -> None:
    """A helper forked for a call exits as soon as its training process is gone, mid-call or not, as the
    training process's own threads would. What it writes is whole or absent either way; and a name an orphan
    went on writing could land after a relaunch wrote the same path anew (``last.ckpt`` back to an older
    step). The relaunch writes again what was cut short (:meth:`~resilience.formats.names.NameWriter.repair`).
    Nothing is sent to it after the call: its connection reads as closed (EOF) when that process is gone (or
    gave up on the call)."""
    fd = conn.fileno()

    def watch() -> None:
        while os.read(fd, 64):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="resilience-parent-watch", daemon=True).start()


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _become(origin: Inherited) -> None:
    """A forked helper takes on its training process's settings."""
    os.environ.clear()  # the fork server's is from when it started; credentials and settings may have changed
    os.environ.update(origin.environ, RESILIENCE_HELPER_PARENT_PID=str(origin.parent_pid))
    with contextlib.suppress(OSError):  # gone since: the training process's relative paths fail there too
        os.chdir(origin.cwd)
    with contextlib.suppress(OSError, ValueError):  # none of them left to this process (its cgroup changed)
        os.sched_setaffinity(0, origin.cpus)
    logging.basicConfig(level=origin.log_level, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    for module in origin.preload:  # instrumentation of the helper: tracing, profiling, fault drills
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise CheckpointError(
                f"the checkpoint helper could not import {module!r}, named in RESILIENCE_HELPER_PRELOAD: "
                f"{describe(exc)}. Put it on the PYTHONPATH the training process starts with (its fork server's "
                "imports come from there), or take it out of RESILIENCE_HELPER_PRELOAD"
            ) from exc


def _call_main(conn: Connection, call: Call) -> None:
    """Run one :class:`Call` and send back its result or its exception."""
    conn.send(call_result(call.function, *call.args, **call.kwargs))


if __name__ == "__main__":
    # The imported module's server, not this ``__main__`` copy's: what the training process sends is pickled
    # as resilience.persist.fork_server's classes, and a helper tells a Call from a pipeline's settings by class.
    import resilience.persist.fork_server

    resilience.persist.fork_server._serve(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    # Its training process is gone. The interpreter's teardown would collect a heap with torch in it (0.4 s of
    # CPU here) while the server still holds the training process's stdout and stderr: whoever reads them to
    # the end (`| tee`, a CI runner, subprocess.run(capture_output=True)) would wait for it. Nothing of the
    # server's needs that teardown; its helpers end on their own connections.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
