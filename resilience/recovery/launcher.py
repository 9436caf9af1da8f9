"""``resilience launch``: start a node's ranks, and replace a lost one without stopping the others.

torchrun's agent restarts every worker when one fails, so the healthy ranks would pay a whole relaunch
(interpreter, imports, process group, reading the checkpoint back) for state they still hold. This launcher
starts the ranks the way torchrun does (the same environment variables, so Lightning, Accelerate and plain
``torch.distributed`` scripts run unchanged) and keeps warm spares: processes already started, with the
script's libraries imported, waiting for a rank to take. When a rank dies (or the survivors ask for a hung one
to be ended), a spare takes its rank number in a new *generation* (a new rendezvous port), and the survivors,
which have committed the last completed step meanwhile, run their script again in the same process
(:mod:`resilience.recovery.inplace`). An agreed stop (a preemption or a GPU fault, exit codes 75 and 69) is not a lost
rank: every rank leaves, and so does the launcher, with that code, for the scheduler to requeue the job.

Several nodes: one launcher per node, sharing node 0's store (``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``); node 0's launcher decides each generation, every node replaces its own lost ranks, and a
node lost whole is replaced by a launcher started with its ``--node-rank`` within ``--node-wait-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from resilience.recovery.bounded_store import BoundedStore
from resilience.recovery.cut_off import end_processes, leave_cut_off
from resilience.recovery.inplace import (
    ENV_BEGAN,
    ENV_GENERATION,
    ENV_LAUNCHER_PID,
    ENV_MARKS,
    ENV_STOP_CODES,
    ENV_STORE,
    STORE_TIMEOUT_S,
    Generation,
    Target,
    evict_key,
    evictions_key,
    failed_key,
    generation_key,
    joined_key,
    left_key,
    node_lost_key,
    ready_key,
    started_key,
    waiting_key,
)
from resilience.recovery.launch_config import LaunchConfig, auto_preload, free_port
from resilience.recovery.lost_nodes import LostNodes
from resilience.recovery.spares import Spares

log = logging.getLogger(__name__)
POLL_S = 0.02
STORE_DELAY_MAX_S = STORE_TIMEOUT_S / 2  # one node's store opens this soon at the latest, well within a rank's wait
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes]


@dataclass
class _Job:
    """This node's view of its ranks in the current generation."""

    workers: dict[int, _Worker] = field(default_factory=dict)  # the ranks whose process is alive
    dead: dict[int, int] = field(default_factory=dict)  # rank -> exit code, lost in this generation
    finished: set[int] = field(default_factory=set)  # ranks whose script ended well
    agreed: int | None = None  # the exit code of an agreed stop a rank here ended with
    generation: Generation = field(default_factory=lambda: Generation(0))
    failing_since: float | None = None  # this generation failed somewhere (a rank lost, or one waiting)
    evictions_seen: int = 0
    ended: Generation | None = None  # the announced end of the job
    stop_deadline: float | None = None


class Launcher:
    """One node's ranks of one job (see the module's docstring).

    Every node's launcher watches its own ranks, ends those its peers name hung, kills its own laggards, and says
    when every live rank of its node waits; node 0's launcher, once every node has said so, announces the next
    generation (or the job's end), and each node then replaces its own lost ranks. Announcements are made with
    ``compare_set`` on the store: the first one for a generation stands, whichever node made it.
    """

    def __init__(self, config: LaunchConfig, argv: Sequence[str]):
        self.config = config
        self.target = Target.parse(argv)
        self.argv = list(argv)
        self.preload = auto_preload(self.target) if config.preload == "auto" else config.preload.split(",")
        self.job = _Job()
        self.leader = config.node_rank == 0
        self._store: Any = None
        self._stop_early = False  # a signal came before the store was open
        self._store_host, self._store_port = config.master_addr, 0
        if config.rdzv_endpoint is not None:
            host, _, port = config.rdzv_endpoint.rpartition(":")
            self._store_host, self._store_port = host, int(port)
        self._run_id = f"resilience-{self._store_host}-{self._store_port}"
        self.spares = Spares(config.spares, config.spare_delay_s, self._command(spare=True), self._base_env)

    # ---- processes -------------------------------------------------------------------------------------------

    def _rank_env(self, rank: int, generation: Generation) -> dict[str, str]:
        assert generation.port is not None
        return {
            **self.config.torchrun_env(rank),
            "MASTER_ADDR": self._store_host,
            "MASTER_PORT": str(generation.port),
            "TORCHELASTIC_RUN_ID": self._run_id,
            "TORCHELASTIC_RESTART_COUNT": str(generation.number),
            ENV_MARKS: self.spares.marks,
            ENV_GENERATION: str(generation.number),
            ENV_BEGAN: repr(time.time()),
        }

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_STORE] = f"{self._store_host}:{self._store_port}"
        env[ENV_STOP_CODES] = ",".join(map(str, self.config.stop_codes))
        env[ENV_LAUNCHER_PID] = str(os.getpid())
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for several ranks on one node
        return env

    def _command(self, *, spare: bool) -> list[str]:
        command = [sys.executable, "-m", "resilience.recovery.inplace"]
        if spare:
            command += ["--spare", "--preload", ",".join(self.preload)]
        return [*command, "--", *self.argv]

    def _start(self, rank: int, generation: Generation) -> None:
        """Rank ``rank`` of ``generation``: a warm spare if one is ready, else a new process."""
        env = self._rank_env(rank, generation)
        spare = self.spares.take()
        if spare is not None:
            assert spare.stdin is not None
            spare.stdin.write((json.dumps({"env": env}) + "\n").encode())
            spare.stdin.close()
            proc = spare
        else:
            proc = subprocess.Popen(self._command(spare=False), env={**self._base_env(), **env})
        self.job.workers[rank] = _Worker(rank, proc)

    # ---- the job ---------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Start this node's ranks and look after them until the job ends; returns the launcher's exit code."""
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        try:
            self._begin()
            while self.job.workers or (self.job.dead and self.job.ended is None):  # ranks to replace still
                try:
                    self._watch()
                except RuntimeError as exc:  # torch's DistNetworkError: the store on node 0 is gone
                    if self.leader:
                        raise
                    self._host_lost(exc)
                    break
                time.sleep(POLL_S)
            self._leave()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.spares.close()
        return self._final_code()

    def _begin(self) -> None:
        """Open the job's store and start this node's ranks in their first generation.

        Node 0 chooses generation 0 itself, so its ranks start before its store does: the launcher's import of
        torch (1.4 s of CPU) does not come before their start, and in a one-node job not beside it either. Its
        announcement is the first in its own store, so it stands. A rank reaches the store only later (its client
        waits for it)."""
        if self.leader:
            if self._store_port == 0:
                self._store_port = free_port(self._store_host)
            first = Generation(0, port=free_port(self._store_host, besides=self._store_port))
            self._start_ranks(first)
            if self.config.nnodes == 1:
                self._await_first_steps()
            self._open_store()
            self._announce(first)
        else:
            self._open_store()
            first = self._first_generation()
            self._start_ranks(first)
        self._store.set(started_key(self.config.node_rank), str(os.getpid()))
        if self._stop_early:  # a signal came before the store was open
            self._stop(None)

    def _await_first_steps(self) -> None:
        """One node: no other launcher waits for its store, and its ranks reach it only after a failure. So the
        store opens once they have done their first step (as a spare starts), a rank has left, a signal has come
        or ``spare_delay_s`` has passed: an import of torch beside their own start slows it on a node with few
        cores (by 0.6 s on 2)."""
        deadline = time.monotonic() + min(self.config.spare_delay_s, STORE_DELAY_MAX_S)
        workers = self.job.workers
        while time.monotonic() < deadline and not self._stop_early and not self.spares.ranks_run(0, workers):
            if any(worker.proc.poll() is not None for worker in workers.values()):
                return
            time.sleep(POLL_S)

    def _start_ranks(self, first: Generation) -> None:
        self.job.generation = first
        if first.port is None:  # joined a job that ended meanwhile
            self.job.ended = first
        for rank in self.config.ranks() if first.port is not None and not self._stop_early else ():
            self._start(rank, first)  # a signal before they started: none is (the stop is announced next)
        self.spares.ranks_started()

    def _open_store(self) -> None:
        from torch.distributed import TCPStore

        store = TCPStore(
            self._store_host,
            self._store_port,
            is_master=self.leader,
            wait_for_workers=False,
            timeout=timedelta(seconds=max(60.0, self.config.recovery_timeout_s)),
        )
        self._store = BoundedStore(store, self.config.store_timeout_s, self._store_lost)
        self._lost = LostNodes(self._store, self.config)

    def _first_generation(self) -> Generation:
        """The generation a node other than 0 starts its ranks in: 0, or for a launcher that replaces a node lost
        whole (its node had started before), the next one node 0 announces once it has seen this launcher join."""
        node = self.config.node_rank
        if not self._store.check([started_key(node)]):
            self._store.wait([generation_key(0)])
            return Generation.decode(0, self._store.get(generation_key(0)))
        current = 0
        while self._store.check([generation_key(current + 1)]):
            current += 1
        log.warning("node %d was lost: this launcher takes its place from generation %d", node, current + 1)
        self._store.set(joined_key(current, node), str(os.getpid()))
        self._store.wait([generation_key(current + 1)], timedelta(seconds=self.config.node_wait_s + 600))
        return Generation.decode(current + 1, self._store.get(generation_key(current + 1)))

    def _leave(self) -> None:
        """Say this node's ranks have all left; node 0 then keeps the store up until every node has (a node lost
        meanwhile costs one recovery timeout at the job's end)."""
        with contextlib.suppress(RuntimeError):
            self._store.set(left_key(self.config.node_rank), "1")
        if not self.leader:
            return
        keys = [left_key(node) for node in range(self.config.nnodes) if node not in self._lost.declared]
        deadline = time.monotonic() + self.config.recovery_timeout_s
        while not self._store.check(keys) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def _store_lost(self, call: str, seconds: float) -> None:
        """From the store's watch: a call to node 0's store has not returned (a partition, or node 0 gone without
        closing its sockets). This node is out of the job; the main thread stays blocked in that call."""
        why = f"the job's store on node 0 did not answer ({call}) for {seconds:.0f} s: this node is cut off"
        procs = [worker.proc for worker in self.job.workers.values()] + self.spares.processes
        leave_cut_off(why, procs, max(self.config.stop_codes, default=75))

    def _host_lost(self, exc: RuntimeError) -> None:
        """Node 0's store went away while ranks here still ran (node 0 died, or its launcher was killed): nothing
        can agree on a generation any more, so the ranks here are stopped and the job ends for the scheduler."""
        log.error("the job's store on node 0 is gone (%s): stopping the ranks on this node", exc)
        job = self.job
        job.ended = Generation(job.generation.number + 1, stop_code=max(self.config.stop_codes, default=75))
        codes = end_processes([worker.proc for worker in job.workers.values()], self.config.stop_grace_s)
        for rank, worker in list(job.workers.items()):
            code = codes[worker.proc.pid]
            del job.workers[rank]
            if code == 0:
                job.finished.add(rank)
            else:
                job.dead[rank] = code
        if not job.dead:
            job.ended = None  # every rank here had ended well: the job is done on this node

    def _announce(self, generation: Generation) -> Generation:
        """Announce ``generation`` unless one of that number stands already; the one that stands."""
        key = generation_key(generation.number)
        return Generation.decode(generation.number, self._store.compare_set(key, "", generation.encode()))

    def _announced(self) -> Generation | None:
        number = self.job.generation.number + 1
        if not self._store.check([generation_key(number)]):
            return None
        return Generation.decode(number, self._store.get(generation_key(number)))

    def _forward(self, signum: int, frame: Any) -> None:
        """A signal to the launcher (a scheduler's preemption notice, Ctrl-C) goes to every rank here; the job ends
        when they leave, and no rank is replaced from then on."""
        self._stop(None)
        for worker in self.job.workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, signum)

    def _watch(self) -> None:
        """One look: who left, who waits, who is to be ended, and what the job's next generation is."""
        job = self.job
        self._lost.beat()
        self._silent_nodes()
        if job.ended is None:
            self.spares.look(job.generation.number, job.workers, self.config.max_restarts - job.generation.restarts)
        number = job.generation.number
        for rank, worker in list(job.workers.items()):
            code = worker.proc.poll()
            if code is None:
                continue
            del job.workers[rank]
            if code == 0:
                job.finished.add(rank)
            elif code in self.config.stop_codes:
                job.agreed = code if job.agreed is None else job.agreed
                job.dead[rank] = code
                self._stop(code)  # an agreed stop: the others leave with the same code
            else:
                log.warning("rank %d left with %s", rank, _describe(code))
                job.dead[rank] = code
                self._store.set(failed_key(number), "1")
        self._evict()
        if job.ended is None:
            nxt = self._announced()
            if nxt is not None and nxt.port is None:
                self._ended(nxt)
            elif nxt is not None:
                self._next_generation(nxt)
                return
        if job.ended is not None:
            self._stop_deadline()
            return
        if job.failing_since is None and self._store.check([failed_key(number)]):
            job.failing_since = time.monotonic()
        if job.failing_since is None:
            return
        waiting = [rank for rank in job.workers if self._store.check([waiting_key(number, rank)])]
        if len(waiting) == len(job.workers):
            if not self._store.check([ready_key(number, self.config.node_rank)]):
                body = {"dead": sorted(job.dead), "finished": sorted(job.finished)}
                self._store.set(ready_key(number, self.config.node_rank), json.dumps(body))
            if self.leader:
                self._decide()
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

    def _silent_nodes(self) -> None:
        """Node 0: a node whose launcher went silent while the job runs is lost (the generation fails, and node 0's
        ranks save without it). Another node: out of the job if node 0 says so (it was cut off for longer than
        ``node_lost_s`` and has come back), as if it had never reached the store again."""
        number = self.job.generation.number
        if self.leader:
            if self._lost.silent(number) and self.job.ended is None:
                self._store.set(failed_key(number), "1")
        elif self._lost.beat_due and self._store.check([node_lost_key(number, self.config.node_rank)]):
            procs = [worker.proc for worker in self.job.workers.values()] + self.spares.processes
            why = f"node 0 declared this node lost in generation {number} (its heartbeat stood while cut off)"
            leave_cut_off(why, procs, max(self.config.stop_codes, default=75))

    def _evict(self) -> None:
        """Ranks here the others found hung (a stopped process): ended, so that the collectives waiting on them fail."""
        job = self.job
        number = job.generation.number
        evictions = int(self._store.add(evictions_key(number), 0))
        if evictions <= job.evictions_seen:
            return
        job.evictions_seen = evictions
        for rank, worker in job.workers.items():
            if self._store.check([evict_key(number, rank)]):
                log.warning("rank %d is hung (its peers say so): ending it", rank)
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()

    def _decide(self) -> None:
        """Node 0: once every node's live ranks wait, the next generation, or the job's end."""
        job, config = self.job, self.config
        number = job.generation.number
        silent = [node for node in range(config.nnodes) if not self._store.check([ready_key(number, node)])]
        if silent:
            assert job.failing_since is not None
            replaced = self._lost.replaced(silent, number, job.failing_since)
            if replaced is None:
                log.error("a node's launcher did not answer after the failure (a node lost): the job ends")
                self._stop(max(config.stop_codes, default=75))
            if not replaced:
                return
        reports = [
            json.loads(self._store.get(ready_key(number, node)))
            if node not in silent
            else {"dead": list(config.ranks(node)), "finished": []}  # its replacement starts them all
            for node in range(config.nnodes)
        ]
        lost = sorted(rank for report in reports for rank in report["dead"])
        finished = sorted(rank for report in reports for rank in report["finished"])
        if finished or job.generation.restarts >= config.max_restarts:
            why = f"ranks {finished} already finished" if finished else "no restarts left"
            log.error("generation %d failed (lost: %s), not restarted (%s): the job ends", number, lost, why)
            self._stop(next((code for code in job.dead.values() if code > 0), 1))
            return
        self._announce(Generation(number + 1, port=free_port(self._store_host), restarts=job.generation.restarts + 1))

    def _next_generation(self, nxt: Generation) -> None:
        """The next generation is announced: this node's lost ranks are replaced (the others run again by
        themselves, in their process)."""
        job = self.job
        lost = sorted(job.dead)
        job.generation, job.failing_since, job.evictions_seen = nxt, None, 0
        self._lost.next_generation()
        for rank in lost:
            self._start(rank, nxt)
        job.dead.clear()
        log.warning(
            "generation %d: rank(s) %s replaced, the others restart in place (restart %d of %d)",
            nxt.number,
            lost,
            nxt.restarts,
            self.config.max_restarts,
        )
        self.spares.ranks_started()

    def _stop(self, code: int | None) -> None:
        """End the job (``code``: its exit code, None: as the ranks end); ranks waiting for a generation are told
        to leave."""
        if self._store is None:  # a signal to node 0 before its store is open: announced once it is
            self._stop_early = True
            return
        if self.job.ended is None:
            stop = Generation(self.job.generation.number + 1, stop_code=code if code is not None else 75)
            self._ended(self._announce(stop))

    def _ended(self, end: Generation) -> None:
        if end.port is not None:  # a generation was announced first: the stop comes with the next look
            return
        self.job.ended = end
        self.job.stop_deadline = time.monotonic() + self.config.stop_grace_s

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
        """An agreed stop's code (the ranks here chose it), else the code the job was ended with, else a failure's
        (a signal as a shell shows it), else 0."""
        job = self.job
        if job.agreed is not None:
            return job.agreed
        if job.ended is not None and job.ended.stop_code is not None:
            return job.ended.stop_code
        failed = [code for code in job.dead.values() if code != 0]
        if failed:
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        return 0


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def launch(args: argparse.Namespace) -> int:
    target = list(args.target)
    if target[:1] == ["--"]:
        target = target[1:]
    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    config = LaunchConfig(**{name: value for name, value in vars(args).items() if name in names})
    return Launcher(config, target).run()


__all__ = ["Launcher", "launch"]
