"""What ``resilience launch`` is told, and what it works out before it starts a process: its settings
(:class:`LaunchConfig`, the command line's options) and the modules a warm spare imports ahead of its rank.

The launcher itself (:mod:`resilience.recovery.launcher`) runs what these describe.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import os
import socket
import sysconfig
from dataclasses import dataclass

from resilience.errors import ConfigError
from resilience.recovery.inplace import EXIT_CONFIG_ERROR, Target


@dataclass
class LaunchConfig:
    """How ``resilience launch`` runs one node's ranks of a job.

    Attributes:
        nproc_per_node: Ranks on this node.
        nnodes: Nodes in the job, one launcher on each; the world size is ``nnodes * nproc_per_node``.
        node_rank: This node's number (0 to ``nnodes - 1``); node 0's launcher hosts the job's store and decides
            each generation, and its host runs rank 0, whose address is the ranks' rendezvous.
        rdzv_endpoint: ``host:port`` of node 0's launcher store (every node passes the same); default with one
            node: ``master_addr`` and a free port.
        max_restarts: How many times the job may restart (a new generation: the lost ranks replaced, the others
            running their script again in place); one more failure ends the job with the lost rank's exit code.
        spares: Warm processes kept ready on this node to take a lost rank (0: a replacement starts cold, paying
            the interpreter and imports, 2 to 6 s with torch and a framework).
        spare_delay_s: How long this node waits, after its ranks start or restart, before it starts its spares,
            unless every rank here says sooner that its first step is done (the pack's session does; a script of
            one's own may call ``resilience.recovery.inplace.running()``). A spare's interpreter and imports
            (seconds of CPU) would otherwise compete for the node's cores with the ranks' own start and restore.
            A failure before the spare is started gets a replacement started cold.
        preload: Modules a spare imports before it is given a rank; ``"auto"``: the third-party modules the script
            imports (read from its source, never the user's own, whose import may depend on the rank).
        stop_codes: Exit codes that end the job: the other ranks leave too, with the same code, and so does the
            launcher (69: a GPU fault, move the job; 75: preempted, run it again; 2: a usage or configuration
            error, which running the same command again cannot fix).
        stop_grace_s: After one rank's agreed stop, how long the others may take to leave before they are killed.
        recovery_timeout_s: After a rank is lost, how long the others may take to end their generation (their
            survivor save included) before they are killed and replaced too; a node whose launcher does not
            answer within twice that (or whose launcher's heartbeat stops) is lost whole (see ``node_wait_s``).
        node_lost_s: A node whose launcher's heartbeat stands this long is lost whole (gone, or cut off by the
            network), judged by node 0 at any time, not only after a failure: node 0's ranks then save what their
            replicas hold and leave their stuck collectives. Shorter cuts are ridden out (after one, TCP takes up
            to about twice its length to resume).
        store_timeout_s: A call to the job's store (on node 0) that has not returned after this long means this
            node is cut off from node 0: its ranks are ended (their state is the other side's to save) and the
            launcher exits 75, for its scheduler to see.
        node_wait_s: When a node's launcher is lost (a node lost whole), how long node 0 waits for a replacement: a
            launcher started with that ``--node-rank`` while the job runs. It then starts that node's ranks in the
            next generation, and the others restart in place. 0 (the default): the job ends with 75 at once, for
            the scheduler to run it again.
        master_addr: This node's address for the store and, on node 0, for the ranks' rendezvous.
    """

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    max_restarts: int = 3
    spares: int = 1
    spare_delay_s: float = 10.0
    preload: str = "auto"
    stop_codes: tuple[int, ...] = (EXIT_CONFIG_ERROR, 69, 75)
    stop_grace_s: float = 120.0
    recovery_timeout_s: float = 120.0
    node_wait_s: float = 0.0
    node_lost_s: float = 30.0
    store_timeout_s: float = 30.0
    master_addr: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigError(f"nproc_per_node={self.nproc_per_node}, nnodes={self.nnodes}: use 1 or more")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank={self.node_rank}: use 0 to nnodes - 1 ({self.nnodes - 1})")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ConfigError("several nodes need --rdzv-endpoint HOST:PORT, node 0's address and a free port")
        if self.node_lost_s <= 0 or self.store_timeout_s <= 0:
            raise ConfigError(
                f"node_lost_s={self.node_lost_s}, store_timeout_s={self.store_timeout_s}: use positive seconds "
                "(30 rides out short network cuts)"
            )
        if self.max_restarts < 0 or self.spares < 0 or self.spare_delay_s < 0:
            raise ConfigError(
                f"max_restarts={self.max_restarts}, spares={self.spares}, spare_delay_s={self.spare_delay_s}: use 0 "
                "or more"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def torchrun_env(self, rank: int) -> dict[str, str]:
        """What torchrun sets for ``rank`` that this configuration decides (the rendezvous comes per generation)."""
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank - self.ranks().start),
            "GROUP_RANK": str(self.node_rank),
            "ROLE_RANK": str(rank),
            "NODE_RANK": str(self.node_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_NAME": "default",
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
        }

    def ranks(self, node: int | None = None) -> range:
        """The global ranks of node ``node`` (default: this node)."""
        node = self.node_rank if node is None else node
        return range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``resilience launch``'s options: :class:`LaunchConfig`'s fields."""
    defaults = LaunchConfig()
    add = parser.add_argument
    add("--nproc-per-node", type=int, default=defaults.nproc_per_node, help="ranks on this node")
    add("--nnodes", type=int, default=defaults.nnodes, help="nodes in the job, one launcher on each")
    add("--node-rank", type=int, default=defaults.node_rank, help="this node's number; node 0 decides")
    add("--rdzv-endpoint", default=defaults.rdzv_endpoint, help="HOST:PORT of node 0's launcher store")
    add("--max-restarts", type=int, default=defaults.max_restarts, help="restarts (generations) the job may make")
    add("--spares", type=int, default=defaults.spares, help="warm processes kept ready to take a lost rank")
    add("--spare-delay-s", type=float, default=defaults.spare_delay_s, help="most a spare waits for ranks to run")
    add("--preload", default=defaults.preload, help="modules a spare imports first (comma list, or 'auto')")
    add("--stop-grace-s", type=float, default=defaults.stop_grace_s, help="how long ranks may take to stop")
    add("--recovery-timeout-s", type=float, default=defaults.recovery_timeout_s, help="how long survivors may take")
    add("--node-wait-s", type=float, default=defaults.node_wait_s, help="wait for a lost node's replacement launcher")
    add("--node-lost-s", type=float, default=defaults.node_lost_s, help="a silent node's launcher is lost after")
    add("--store-timeout-s", type=float, default=defaults.store_timeout_s, help="a store call unanswered this long")
    add("--master-addr", default=defaults.master_addr, help="this node's address for the store (one node)")
    add("target", nargs=argparse.REMAINDER, help="the script and its arguments, or -m module and its arguments")


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


def free_port(host: str, besides: int = 0) -> int:
    """A port no one listens on now (other than ``besides``, chosen before and not bound yet)."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port != besides:
            return port
