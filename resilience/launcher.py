"""``resilience launch``: start a node's ranks, and replace a lost one without stopping the others.

torchrun's agent restarts every worker when one fails, so the healthy ranks would pay a whole relaunch
(interpreter, imports, process group, reading the checkpoint back) for state they still hold. This launcher
starts the ranks the way torchrun does (the same environment variables, so Lightning, Accelerate and plain
``torch.distributed`` scripts run unchanged) and keeps warm spares: processes already started, with the
script's libraries imported, waiting for a rank to take. When a rank dies (or the survivors ask for a hung one
to be ended), a spare takes its rank number in a new *generation* (a new rendezvous port), and the survivors,
which have committed the last completed step meanwhile, run their script again in the same process
(:mod:`resilience.inplace`). An agreed stop (a preemption or a GPU fault, exit codes 75 and 69) is not a lost
rank: every rank leaves, and so does the launcher, with that code, for the scheduler to requeue the job.

One node per launcher; several nodes are not supported yet (docs/RECOVERY.md).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from resilience.errors import ConfigError
from resilience.inplace import (
    ENV_BEGAN,
    ENV_GENERATION,
    ENV_LAUNCHER_PID,
    ENV_STOP_CODES,
    ENV_STORE,
    Generation,
    Target,
    evict_key,
    evictions_key,
    generation_key,
    waiting_key,
)

log = logging.getLogger(__name__)
POLL_S = 0.02
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class LaunchConfig:
    """How ``resilience launch`` runs a node's ranks.

    Attributes:
        nproc_per_node: Ranks on this node (the job's world size: one node per launcher).
        max_restarts: How many times the job may restart (a new generation: the lost ranks replaced, the others
            running their script again in place); one more failure ends the job with the lost rank's exit code.
        spares: Warm processes kept ready to take a lost rank (0: a replacement starts cold, paying the
            interpreter and imports, 2 to 6 s with torch and a framework).
        preload: Modules a spare imports before it is given a rank; ``"auto"``: the third-party modules the script
            imports (read from its source, never the user's own, whose import may depend on the rank).
        stop_codes: Exit codes of an agreed stop: the other ranks leave too, with the same code, and so does the
            launcher (69: a GPU fault, move the job; 75: preempted, run it again).
        stop_grace_s: After one rank's agreed stop, how long the others may take to leave before they are killed.
        recovery_timeout_s: After a rank is lost, how long the others may take to end their generation (their
            survivor save included) before they are killed and replaced too.
        master_addr: The address the ranks' rendezvous listens on.
    """

    nproc_per_node: int = 1
    max_restarts: int = 3
    spares: int = 1
    preload: str = "auto"
    stop_codes: tuple[int, ...] = (69, 75)
    stop_grace_s: float = 120.0
    recovery_timeout_s: float = 120.0
    master_addr: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"nproc_per_node={self.nproc_per_node}: use 1 or more")
        if self.max_restarts < 0 or self.spares < 0:
            raise ConfigError(f"max_restarts={self.max_restarts}, spares={self.spares}: use 0 or more")


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def auto_preload(target: Target) -> list[str]:
    """The top-level modules ``target`` imports that are installed libraries (the standard library's and
    site-packages'), in source order; the user's own modules stay out of a spare (their import may read the
    rank from the environment)."""
    path = target.path
    if path is None:
        assert target.module is not None
        spec = importlib.util.find_spec(target.module)
        path = spec.origin if spec is not None else None
    if path is None or not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as stream:
        tree = ast.parse(stream.read(), path)
    libraries = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib", "stdlib")}
    found: list[str] = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        for name in names:
            if name in found:
                continue
            with contextlib.suppress(Exception):
                spec = importlib.util.find_spec(name.split(".")[0])
                origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else ""
                if any(origin.startswith(root + os.sep) for root in libraries):
                    found.append(name)
    return found


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes]


@dataclass
class _Job:
    """The launcher's view of the ranks of the current generation."""

    workers: dict[int, _Worker] = field(default_factory=dict)  # the ranks whose process is alive
    spares: list[subprocess.Popen[bytes]] = field(default_factory=list)
    dead: dict[int, int] = field(default_factory=dict)  # rank -> exit code, lost in this generation
    finished: set[int] = field(default_factory=set)  # ranks whose script ended well
    generation: int = 0
    restarts: int = 0
    failing_since: float | None = None  # the generation failed (a rank lost, or one waiting for the next)
    evictions_seen: int = 0
    stopping: bool = False  # the job ends once its ranks have left
    failed: int | None = None  # why the launcher ended the job itself (a failure it does not restart)
    stop_deadline: float | None = None


class Launcher:
    """One node's ranks of one job (see the module's docstring)."""

    def __init__(self, config: LaunchConfig, argv: Sequence[str]):
        self.config = config
        self.target = Target.parse(argv)
        self.argv = list(argv)
        self.preload = auto_preload(self.target) if config.preload == "auto" else config.preload.split(",")
        self.job = _Job()
        self._store: Any = None
        self._store_port = 0
        self._run_id = f"resilience-{os.getpid()}"

    # ---- processes -------------------------------------------------------------------------------------------

    def _rank_env(self, rank: int, generation: Generation) -> dict[str, str]:
        world = self.config.nproc_per_node
        assert generation.port is not None
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "ROLE_WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "MASTER_ADDR": self.config.master_addr,
            "MASTER_PORT": str(generation.port),
            "TORCHELASTIC_RUN_ID": self._run_id,
            "TORCHELASTIC_RESTART_COUNT": str(generation.number),
            "TORCHELASTIC_MAX_RESTARTS": str(self.config.max_restarts),
            ENV_GENERATION: str(generation.number),
            ENV_BEGAN: repr(time.time()),
        }

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_STORE] = f"{self.config.master_addr}:{self._store_port}"
        env[ENV_STOP_CODES] = ",".join(map(str, self.config.stop_codes))
        env[ENV_LAUNCHER_PID] = str(os.getpid())
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for several ranks on one node
        return env

    def _command(self, *, spare: bool) -> list[str]:
        command = [sys.executable, "-m", "resilience.inplace"]
        if spare:
            command += ["--spare", "--preload", ",".join(self.preload)]
        return [*command, "--", *self.argv]

    def _start(self, rank: int, generation: Generation) -> None:
        """Rank ``rank`` of ``generation``: a warm spare if one is ready, else a new process."""
        env = self._rank_env(rank, generation)
        spare = self._take_spare()
        if spare is not None:
            assert spare.stdin is not None
            spare.stdin.write((json.dumps({"env": env}) + "\n").encode())
            spare.stdin.close()
            proc = spare
        else:
            proc = subprocess.Popen(self._command(spare=False), env={**self._base_env(), **env})
        self.job.workers[rank] = _Worker(rank, proc)

    def _take_spare(self) -> subprocess.Popen[bytes] | None:
        while self.job.spares:
            spare = self.job.spares.pop(0)
            if spare.poll() is None:
                return spare
            log.warning("a spare process exited with code %s before it was needed", spare.returncode)
        return None

    def _fill_spares(self) -> None:
        left = self.config.max_restarts - self.job.restarts
        while len(self.job.spares) < min(self.config.spares, left):
            self.job.spares.append(
                subprocess.Popen(self._command(spare=True), env=self._base_env(), stdin=subprocess.PIPE)
            )

    # ---- the job ---------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Start the ranks and look after them until the job ends; returns the launcher's exit code."""
        from torch.distributed import TCPStore

        self._store_port = free_port(self.config.master_addr)
        self._store = TCPStore(self.config.master_addr, self._store_port, is_master=True, wait_for_workers=False)
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        try:
            first = self._announce(Generation(0, port=free_port(self.config.master_addr)))
            for rank in range(self.config.nproc_per_node):
                self._start(rank, first)
            self._fill_spares()
            while self.job.workers:
                self._watch()
                time.sleep(POLL_S)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for spare in self.job.spares:
                with contextlib.suppress(OSError):
                    spare.kill()
                spare.wait()
        return self._final_code()

    def _announce(self, generation: Generation) -> Generation:
        self._store.set(generation_key(generation.number), generation.encode())
        return generation

    def _forward(self, signum: int, frame: Any) -> None:
        """A signal to the launcher (a scheduler's preemption notice, Ctrl-C) goes to every rank; the job ends
        when they leave, and no rank is replaced from then on."""
        self._stop()
        for worker in self.job.workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, signum)

    def _watch(self) -> None:
        """One look at the ranks: who left, who waits for the next generation, who is to be ended."""
        job = self.job
        for rank, worker in list(job.workers.items()):
            code = worker.proc.poll()
            if code is None:
                continue
            del job.workers[rank]
            if code == 0:
                job.finished.add(rank)
            elif code in self.config.stop_codes:
                self._stop()  # an agreed stop: the others leave with the same code
                job.dead[rank] = code
            else:
                log.warning("rank %d left with %s", rank, _describe(code))
                job.dead[rank] = code
                self._failing()
        self._evict()
        if job.stopping:
            self._stop_deadline()
            return
        waiting = [rank for rank in job.workers if self._store.check([waiting_key(job.generation, rank)])]
        if waiting:
            self._failing()
        if job.failing_since is None:
            return
        if len(waiting) == len(job.workers):
            self._next_generation()
        elif time.monotonic() - job.failing_since > self.config.recovery_timeout_s:
            for rank, worker in job.workers.items():
                if rank not in waiting:
                    log.error(
                        "rank %d did not end its generation within %.0f s of the failure: killing it",
                        rank,
                        self.config.recovery_timeout_s,
                    )
                    with contextlib.suppress(ProcessLookupError):
                        worker.proc.kill()
            job.failing_since = time.monotonic()

    def _failing(self) -> None:
        if self.job.failing_since is None:
            self.job.failing_since = time.monotonic()

    def _evict(self) -> None:
        """Ranks the others found hung (a stopped process): ended, so that the collectives waiting on them fail."""
        job = self.job
        evictions = int(self._store.add(evictions_key(job.generation), 0))
        if evictions <= job.evictions_seen:
            return
        job.evictions_seen = evictions
        for rank, worker in job.workers.items():
            if self._store.check([evict_key(job.generation, rank)]):
                log.warning("rank %d is hung (its peers say so): ending it", rank)
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()

    def _next_generation(self) -> None:
        """Every live rank waits: the lost ones are replaced and all run again, or the job ends."""
        job = self.job
        lost = sorted(job.dead)
        if job.finished or job.restarts >= self.config.max_restarts:
            why = f"ranks {sorted(job.finished)} already finished" if job.finished else "no restarts left"
            log.error("generation %d failed (lost: %s), not restarted (%s): the job ends", job.generation, lost, why)
            job.failed = next((c for c in job.dead.values() if c > 0), 1)
            self._stop()
            return
        job.restarts += 1
        job.generation += 1
        job.failing_since = None
        job.evictions_seen = 0
        nxt = self._announce(Generation(job.generation, port=free_port(self.config.master_addr)))
        for rank in lost:
            self._start(rank, nxt)
        job.dead.clear()
        log.warning(
            "generation %d: rank(s) %s replaced, the others restart in place (restart %d of %d)",
            nxt.number,
            lost,
            job.restarts,
            self.config.max_restarts,
        )
        self._fill_spares()

    def _stop(self) -> None:
        """The job ends: ranks waiting for a generation are told to leave (with the survivors' stop code)."""
        job = self.job
        if not job.stopping:
            job.stopping = True
            job.stop_deadline = time.monotonic() + self.config.stop_grace_s
            self._announce(Generation(job.generation + 1, stop_code=max(self.config.stop_codes, default=1)))

    def _stop_deadline(self) -> None:
        job = self.job
        if job.stop_deadline is not None and time.monotonic() > job.stop_deadline:
            for worker in job.workers.values():
                log.error(
                    "rank %d did not leave within %.0f s of the stop: killing it", worker.rank, self.config.stop_grace_s
                )
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
            job.stop_deadline = None

    def _final_code(self) -> int:
        """An agreed stop's code, else the failure's (a signal as a shell shows it), else 0."""
        job = self.job
        codes = list(job.dead.values())
        agreed = [code for code in codes if code in self.config.stop_codes]
        if agreed:
            return agreed[0]
        if job.failed is not None:
            return job.failed
        failed = [code for code in codes if code != 0]
        return (failed[0] if failed[0] > 0 else 128 - failed[0]) if failed else 0


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``resilience launch``'s options: :class:`LaunchConfig`'s fields."""
    defaults = LaunchConfig()
    add = parser.add_argument
    add("--nproc-per-node", type=int, default=defaults.nproc_per_node, help="ranks on this node (the world size)")
    add("--max-restarts", type=int, default=defaults.max_restarts, help="restarts (generations) the job may make")
    add("--spares", type=int, default=defaults.spares, help="warm processes kept ready to take a lost rank")
    add("--preload", default=defaults.preload, help="modules a spare imports first (comma list, or 'auto')")
    add("--stop-grace-s", type=float, default=defaults.stop_grace_s, help="how long ranks may take to stop")
    add("--recovery-timeout-s", type=float, default=defaults.recovery_timeout_s, help="how long survivors may take")
    add("--master-addr", default=defaults.master_addr, help="the address the ranks' rendezvous listens on")
    add("target", nargs=argparse.REMAINDER, help="the script and its arguments, or -m module and its arguments")


def launch(args: argparse.Namespace) -> int:
    target = list(args.target)
    if target[:1] == ["--"]:
        target = target[1:]
    config = LaunchConfig(
        nproc_per_node=args.nproc_per_node,
        max_restarts=args.max_restarts,
        spares=args.spares,
        preload=args.preload,
        stop_grace_s=args.stop_grace_s,
        recovery_timeout_s=args.recovery_timeout_s,
        master_addr=args.master_addr,
    )
    return Launcher(config, target).run()


__all__ = ["LaunchConfig", "Launcher", "auto_preload", "launch"]
