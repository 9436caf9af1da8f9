"""Restart in place: after a rank is lost, the healthy ranks' processes stay and train on.

Under ``resilience launch`` (:mod:`resilience.recovery.launcher`) every rank runs its script through :func:`run`, in
*generations*. When a rank dies or hangs, the survivors commit the last completed step among themselves (the
survivor save, :mod:`resilience.recovery.survivors`), and the session asks for a restart in place (:func:`request`)
instead of leaving the process. The framework then unwinds as it does for any error (Lightning's and
Accelerate's teardown run), the script ends, and :func:`run` closes what the generation left open (the
checkpoint engines, the process group), waits for the launcher to announce the next generation (the lost rank
replaced by a process already started and imported), and runs the script again in the same process: its
imports, the CUDA context and the page cache holding the survivor save stay, so the script's second run only
pays the framework's set-up and a resume from local disk.

Why the script runs again rather than the same ``fit()`` going on: a fresh rank's start-up (the process
group's rendezvous, the strategy's and loggers' broadcasts, DDP's parameter broadcast) is a sequence of
collectives the healthy ranks would have to mirror one by one, and neither framework exposes it. Running the
same code on every rank keeps those collectives matched by construction.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import runpy
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

from resilience.checkpoint import open_engines
from resilience.errors import ConfigError
from resilience.recovery.preload import preload

log = logging.getLogger(__name__)

ENV_STORE = "RESILIENCE_LAUNCH_STORE"  # host:port of the launcher's store; set for every rank it starts
ENV_GENERATION = "RESILIENCE_GENERATION"  # the generation this process trains in
ENV_BEGAN = "RESILIENCE_GENERATION_BEGAN"  # unix time this process was given its generation (its account begins)
ENV_STOP_CODES = "RESILIENCE_STOP_CODES"  # exit codes of an agreed stop: the rank leaves, no restart in place
ENV_LAUNCHER_PID = "RESILIENCE_LAUNCHER_PID"
ENV_MARKS = "RESILIENCE_LAUNCH_MARKS"  # a folder on this node where a rank says its first step is done (see running)
PR_SET_PDEATHSIG = 1  # prctl(2)
EXIT_INTERRUPTED = 130
# A configuration error (the pack's ConfigError): the same command fails the same way, so it ends the job rather
# than being run again; 2, as for usage errors (argparse's, the resilience command's).
EXIT_CONFIG_ERROR = 2
STORE_TIMEOUT_S = 60.0  # a rank's wait for the launcher's store to answer, its first connection included
NEXT_GENERATION_WAIT_S = 600.0  # how long survivors wait for the launcher to replace the lost rank


def generation_key(number: int) -> str:
    return f"gen/{number}"


def waiting_key(generation: int, rank: int) -> str:
    """Set once rank ``rank`` of ``generation`` has ended its script and waits for the next generation."""
    return f"waiting/{generation}/{rank}"


def evict_key(generation: int, rank: int) -> str:
    return f"evict/{generation}/{rank}"


def evictions_key(generation: int) -> str:
    return f"evictions/{generation}"


def failed_key(generation: int) -> str:
    """Set once a rank of ``generation`` is lost (by its node's launcher) or waits (by the rank itself): from then
    on every node's launcher recovers."""
    return f"failed/{generation}"


def ready_key(generation: int, node: int) -> str:
    """Set by node ``node``'s launcher once every live rank there waits: JSON, the ranks it lost and those whose
    script ended well."""
    return f"ready/{generation}/{node}"


def beat_key(node: int) -> str:
    """A counter node ``node``'s launcher raises every second: node 0 tells a node lost whole (its count stands)
    from one whose ranks are slow to end their generation, without trusting either machine's clock."""
    return f"beat/{node}"


def started_key(node: int) -> str:
    """Set by node ``node``'s launcher once it has started its ranks: a launcher that finds it set replaces a node
    lost whole."""
    return f"started/{node}"


def joined_key(generation: int, node: int) -> str:
    """Set by a launcher that replaces node ``node`` while ``generation`` runs: node 0 may then go on without the
    lost node's own launcher."""
    return f"joined/{generation}/{node}"


def node_lost_key(generation: int, node: int) -> str:
    """Set by node 0's launcher when node ``node``'s launcher went silent while ``generation`` ran (a node gone or
    cut off): node 0's ranks save without its ranks, and its launcher, should it reach the store again, ends its
    ranks rather than rejoin."""
    return f"node_lost/{generation}/{node}"


def left_key(node: int) -> str:
    """Set by node ``node``'s launcher once every rank there has left: node 0 hosts the store and keeps it up until
    every node has said so, or a node still finishing would find the store gone."""
    return f"left/{node}"


@dataclass(frozen=True)
class Generation:
    """What the launcher announces for one generation: its rendezvous port and how many restarts the job has made,
    or the code the job ends with."""

    number: int
    port: int | None = None
    stop_code: int | None = None
    restarts: int = 0

    def encode(self) -> str:
        return json.dumps({"port": self.port, "stop_code": self.stop_code, "restarts": self.restarts})

    @classmethod
    def decode(cls, number: int, text: bytes | str) -> Generation:
        body = json.loads(text)
        return cls(number, body.get("port"), body.get("stop_code"), int(body.get("restarts", 0)))


_requested: str | None = None  # why this process restarts in place once its script ends
_before_next: list[Callable[[], None]] = []  # what to close before the next generation (see before_next_generation)
# a collective's error that ended the script with no survivor save: its report (the traceback, and one line), held
# until the launcher says whether the job restarts (see _report_end)
_held: tuple[str, str] | None = None
_LOST_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_store: Any = None
_said_running: int | None = None  # the generation this process has said it runs in (see running)


def active() -> bool:
    """Whether this process runs under ``resilience launch``, which can replace a lost rank."""
    return ENV_STORE in os.environ


def generation() -> int:
    return int(os.environ.get(ENV_GENERATION, "0"))


def request(why: str) -> None:
    """Restart this process in place once its script has ended (a survivor save was made, or tried)."""
    global _requested
    if _requested is None:
        _requested = why
        log.warning("rank %s: restarting in place after this generation (%s)", os.environ.get("RANK", "?"), why)


def running_mark(folder: str, generation: int, rank: int) -> str:
    """The file rank ``rank`` makes in its launcher's ``folder`` once its first step of ``generation`` is done."""
    return os.path.join(folder, f"{generation}.{rank}")


def running() -> None:
    """Say, once per generation, that this rank is past its start (its first step is done): its node's launcher
    starts its warm spare then, not while the ranks' own start (interpreter, imports, restore) needs the cores. A
    file on this node, not a key in the job's store: a step never waits on the network. The pack's session calls
    it at every step's end; a script of one's own may call it too (otherwise the spare waits ``spare_delay_s``)."""
    global _said_running
    folder = os.environ.get(ENV_MARKS)
    if folder is None:  # not under resilience launch: one lookup a step
        return
    number = generation()
    if _said_running == number:
        return
    _said_running = number
    with contextlib.suppress(OSError):  # the launcher's folder gone: the spare starts after its delay
        open(running_mark(folder, number, int(os.environ["RANK"])), "a").close()


def requested() -> str | None:
    return _requested


def before_next_generation(hook: Callable[[], None]) -> None:
    """Run ``hook`` (once per generation, in registration order) before the script runs again: for state a
    generation leaves in the process that the next one must not find (an engine still open, a framework's
    process-wide singleton)."""
    if hook not in _before_next:
        _before_next.append(hook)


def store() -> Any:
    """The launcher's store (a TCPStore client), connected on first use."""
    global _store
    if _store is None:
        from torch.distributed import TCPStore

        host, _, port = os.environ[ENV_STORE].rpartition(":")
        _store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    return _store


def nodes() -> int:
    """The job's nodes under ``resilience launch`` (1 outside it)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1) if active() else 1


def lost_node_ranks() -> set[int]:
    """The ranks of the nodes node 0's launcher declared lost in this generation (gone, or cut off); empty with one
    node or outside ``resilience launch``. The launcher places ranks node by node (``LOCAL_WORLD_SIZE`` each)."""
    count = nodes()
    if count < 2:
        return set()
    per_node, mine, number = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ["GROUP_RANK"]), generation()
    lost: set[int] = set()
    for node in range(count):
        if node != mine and store().check([node_lost_key(number, node)]):
            lost.update(range(node * per_node, (node + 1) * per_node))
    return lost


def evict(ranks: Iterable[int]) -> None:
    """Ask the launcher to end ``ranks`` (stopped or hung): the collectives the healthy ranks are stuck in with
    them then fail, and every healthy rank's training thread unwinds to the restart."""
    number = generation()
    for rank in ranks:
        store().set(evict_key(number, rank), "1")
        store().add(evictions_key(number), 1)


def wait_for_generation(number: int, timeout_s: float) -> Generation | None:
    """The launcher's announcement of generation ``number``; None if none came within ``timeout_s``."""
    key = generation_key(number)
    try:
        store().wait([key], timedelta(seconds=timeout_s))
    except Exception:  # the store raises on timeout (and when the launcher is gone)
        return None
    return Generation.decode(number, store().get(key))


def _stop_codes() -> set[int]:
    return {int(code) for code in os.environ.get(ENV_STOP_CODES, "").split(",") if code}


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # what the interpreter does with SystemExit("message")
    return 1


@dataclass(frozen=True)
class Target:
    """The script (or module, as ``python -m``) each generation runs, and its arguments."""

    path: str | None
    module: str | None
    args: tuple[str, ...]

    @classmethod
    def parse(cls, argv: Sequence[str]) -> Target:
        if argv and argv[0] == "-m":
            if len(argv) < 2:
                raise SystemExit("resilience launch: -m needs a module name")
            return cls(None, argv[1], tuple(argv[2:]))
        if not argv:
            raise SystemExit("resilience launch: name the training script (or -m module) to run")
        return cls(os.path.abspath(argv[0]), None, tuple(argv[1:]))

    def run_once(self) -> int:
        """Run the script as ``python`` would run it; its exit code (an uncaught error is reported as the
        interpreter reports it: through ``sys.excepthook``, which is where Accelerate's handle saves)."""
        try:
            if self.module is not None:
                sys.argv = [self.module, *self.args]
                runpy.run_module(self.module, run_name="__main__", alter_sys=True)
            else:
                assert self.path is not None
                sys.argv = [self.path, *self.args]
                sys.path[0] = os.path.dirname(self.path)  # as `python script.py` sets it
                runpy.run_path(self.path, run_name="__main__")
        except SystemExit as exc:
            return _exit_code(exc.code)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except ConfigError:
            sys.excepthook(*sys.exc_info())
            return EXIT_CONFIG_ERROR
        except BaseException as exc:
            _report_end(exc)
            return 1
        return 0


def _report_end(exc: BaseException) -> None:
    """Report the error that ended the script, through ``sys.excepthook`` as the interpreter would.

    When it is the error a lost peer leaves (a collective failed) and the survivors saved and asked for a restart
    in place, the event was handled: one line, and the traceback only at DEBUG. The hooks decide that: under
    Accelerate the survivors' save runs inside the handle's excepthook, so the hook's output is held until it has
    returned, then printed as it was or turned into that line. With no survivor save (node-local disks), such an
    error is held until the launcher says whether the job restarts (:func:`_settle_report`)."""
    global _held
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        sys.excepthook(type(exc), exc, exc.__traceback__)
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    if requested() is not None:
        log.warning(
            "rank %s: training ended as its peer was lost (%s: %s)",
            os.environ.get("RANK", "?"),
            type(exc).__name__,
            first,
        )
        log.debug("the error that ended this generation:\n%s", printed.getvalue())
    elif _lost_peer_error(exc):  # no survivor save (node-local disks): handled if the launcher restarts the job
        _held = (printed.getvalue(), f"{type(exc).__name__}: {first}")
    else:
        sys.stderr.write(printed.getvalue())
        sys.stderr.flush()


def _lost_peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is what a collective raises when a peer is gone."""
    from torch.distributed import DistError

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, DistError) or any(word in str(cause) for word in _LOST_PEER_WORDS):
            return True
        cause = cause.__cause__
    return False


def _settle_report(restarting: bool) -> None:
    """A held report (:func:`_report_end`): one line when the job restarts, the lost peer's being handled (the
    traceback at DEBUG); the traceback as it was when it does not."""
    global _held
    held, _held = _held, None
    if held is None:
        return
    if restarting:
        log.warning("rank %s: training ended as a peer was lost (%s); restarting", os.environ.get("RANK", "?"), held[1])
        log.debug("the error that ended this generation:\n%s", held[0])
    else:
        sys.stderr.write(held[0])
        sys.stderr.flush()


def _close_generation() -> None:
    """What a generation leaves that the next must not find: the checkpoint engines still open, the hooks'
    (framework singletons), then the process group (all its subgroups with it)."""
    for hook in [open_engines.abandon_open, *_before_next]:
        try:
            hook()
        except Exception:
            log.exception("closing the generation: %r failed", hook)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        log.exception("closing the generation: destroying the process group failed")
    gc.collect()


def run(target: Target) -> NoReturn:
    """Run ``target`` in generations until it ends for good; exits the process with its final code.

    A script that ends well, is interrupted, or ends with an agreed stop (a preemption, a GPU fault) ends the
    process. Any other end (a survivor save asked for a restart, or an error) closes the generation, tells the
    launcher this rank waits, and runs the script again in the generation the launcher announces: the whole job
    restarts from its last commit, with the processes that are still alive.
    """
    global _requested
    excepthook = sys.excepthook
    while True:
        code = target.run_once()
        why, _requested = _requested, None
        sys.excepthook = excepthook  # torch.distributed wraps it once per process group: not once per generation
        if why is None and (code == 0 or code == EXIT_INTERRUPTED or code in _stop_codes()):
            sys.exit(code)
        number = generation()
        _close_generation()  # first: peers still blocked in a collective with this rank now fail, and wait too
        try:
            store().set(waiting_key(number, int(os.environ["RANK"])), str(code))
            store().set(failed_key(number), "1")
        except Exception as exc:
            _settle_report(restarting=False)
            log.error("the launcher's store is gone (%s): this rank ends", exc)
            sys.exit(code or 1)
        nxt = wait_for_generation(number + 1, NEXT_GENERATION_WAIT_S)
        _settle_report(restarting=nxt is not None and nxt.port is not None)
        if nxt is None:
            log.error("no new generation came from the launcher within %.0f s", NEXT_GENERATION_WAIT_S)
            sys.exit(code or 1)
        if nxt.stop_code is not None:
            sys.exit(nxt.stop_code if why is not None or code == 0 else code)
        assert nxt.port is not None
        os.environ.update(
            {
                ENV_GENERATION: str(nxt.number),
                ENV_BEGAN: repr(time.time()),
                "MASTER_PORT": str(nxt.port),
                "TORCHELASTIC_RESTART_COUNT": str(nxt.number),
            }
        )
        print(
            f"training-resilience: rank {os.environ.get('RANK')} (pid {os.getpid()}) restarts in place as "
            f"generation {nxt.number}",
            file=sys.stderr,
            flush=True,
        )


def _end_with_launcher() -> None:
    """SIGTERM this process when the launcher dies (Linux's parent-death signal), so that a launcher killed outright
    (kill -9, an out-of-memory kill) leaves no rank training unwatched; SIGTERM, not SIGKILL, so that a rank with
    the health guard still makes its emergency save. Set here, in the child, rather than between fork and exec,
    where the launcher's store threads make running Python unsafe."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.environ.get(ENV_LAUNCHER_PID) not in (None, str(os.getppid())):
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher died before the signal was set


def main(argv: Sequence[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(prog="python -m resilience.recovery.inplace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spare", action="store_true", help="preload, then wait on stdin for a rank to take")
    parser.add_argument("--preload", default="", help="modules a spare imports before it is assigned (comma list)")
    parser.add_argument("target", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    _end_with_launcher()
    target = Target.parse(args.target[1:] if args.target[:1] == ["--"] else args.target)
    if args.spare:
        preload(m for m in args.preload.split(",") if m)
        line = sys.stdin.readline()
        if not line:  # the launcher closed our stdin without a rank: not needed
            sys.exit(0)
        os.environ.update(json.loads(line)["env"])
    run(target)


if __name__ == "__main__":
    # run as the importable module, not as __main__: the pack's other modules must share its state (the restart
    # request, the hooks), and they import it by name
    from resilience.recovery import inplace as _importable

    _importable.main()
