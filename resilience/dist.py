"""Process groups for checkpoint collectives, and the one way ranks agree on an outcome.

Checkpoint collectives run on gloo groups of their own, one per thread that issues them: the training thread
(control), the writer thread and the uploader thread. Collectives on the training job's default group from a
background thread deadlock against the job's own all-reduces, and two threads sharing one group can
interleave their collectives differently on different ranks.

Every decision ranks must take together goes through :meth:`Channel.agree` (every rank runs a step, then all
learn every outcome and either all go on or all raise the first failing rank's error) or
:meth:`Channel.decide` (one rank decides, all get the answer or its error). A collective that itself fails (a
peer died, a timeout) marks the channel broken: later calls fail at once instead of waiting out a timeout.
"""

from __future__ import annotations

import os
import pickle
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from resilience.errors import CheckpointError, GroupBrokenError, describe

T = TypeVar("T")

# DCP warns on every single-process save/load; the engine chooses single-process mode on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def first_process_of_node() -> bool:
    """Whether the launcher made this the first process of its node (before any process group exists)."""
    return all(os.environ.get(name, "0") in ("", "0") for name in ("LOCAL_RANK", "SLURM_LOCALID"))


@dataclass
class Topology:
    """Where the ranks run: ``hosts[r]`` is rank r's hostname; ``nodes[r]`` its :func:`node_identity`, which
    ranks that write to one local root directory share (a node, in the sense of node-local disks)."""

    rank: int
    world_size: int
    hosts: list[str]
    nodes: list[str]

    @property
    def host(self) -> str:
        return self.hosts[self.rank]

    def ranks_on_my_node(self) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == self.nodes[self.rank]]

    @property
    def single_node(self) -> bool:
        return len(set(self.nodes)) == 1


def node_identity(local_root: str) -> str:
    """What ranks that write into the same local root directory have in common, and no other rank has.

    The machine (its kernel's boot id, else its hostname) and the directory's device and inode: ranks on one
    machine that were given different roots (containers with volumes of their own, which may share the host's
    name; two agents started on one host) are separate nodes, and ranks that reach one directory under different
    paths, or from containers with different hostnames on one machine, are one. A hostname alone gets both wrong.
    Makes the root, which must exist to be identified.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            machine = handle.read().strip()
    except OSError:  # not Linux
        machine = socket.gethostname()
    try:
        os.makedirs(local_root, exist_ok=True)
        info = os.stat(local_root)
    except OSError:  # an unusable root: the set-up check that follows says why, with the fix
        return f"{machine}:{local_root}"
    return f"{machine}:{info.st_dev}:{info.st_ino}"


@dataclass(frozen=True)
class _Outcome:
    """What one rank's part of an agreed step came to: a value, or an error (pickled if it can be)."""

    ok: bool
    value: Any = None
    error: bytes | None = None
    text: str = ""


class Channel:
    """Collectives over one gloo group, or trivial answers when there is only one process.

    Args:
        group: The gloo group, or None in a single process.
        name: What the channel is for, in error messages ("checkpoint writer", ...).
    """

    def __init__(self, group: dist.ProcessGroup | None, name: str = "checkpoint"):
        self.group = group
        self.name = name
        self.broken: str | None = None

    @property
    def active(self) -> bool:
        return self.group is not None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    # ---- agreement -----------------------------------------------------------------------------------------

    def agree(self, step: Callable[[], T]) -> list[T]:
        """Run ``step`` here, then learn every rank's outcome; raise on every rank if it failed on any.

        The rank that failed raises its own exception; the others raise that rank's exception too (its own
        type and message, or a :class:`CheckpointError` naming the rank when it cannot be sent). Returns every
        rank's value, in rank order.
        """
        try:
            outcome = _Outcome(True, step())
        except Exception as exc:
            mine: Exception | None = exc
            outcome = _Outcome(False, error=_pickled(exc), text=describe(exc))
        else:
            mine = None
        outcomes = self.all_gather(outcome)
        if mine is not None:
            raise mine
        for rank, other in enumerate(outcomes):
            if not other.ok:
                raise _revive(other, rank)
        return [o.value for o in outcomes]

    def decide(self, choose: Callable[[], T], src: int = 0) -> T:
        """Run ``choose`` on rank ``src`` only and give every rank its answer, or raise its error everywhere."""
        outcome: _Outcome | None = None
        if self.rank == src:
            try:
                outcome = _Outcome(True, choose())
            except Exception as exc:
                outcome = _Outcome(False, error=_pickled(exc), text=describe(exc))
        received = self.broadcast(outcome, src)
        assert received is not None
        if not received.ok:
            raise _revive(received, src)
        return received.value

    # ---- plain collectives ---------------------------------------------------------------------------------

    def all_gather(self, obj: T) -> list[T]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        self._run(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast(self, obj: T, src: int = 0) -> T:
        if self.group is None:
            return obj
        box: list[Any] = [obj]
        self._run(lambda: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]

    def max(self, values: list[int]) -> list[int]:
        """Element-wise maximum across ranks: one small tensor all-reduce, cheap enough for every step."""
        if self.group is None:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        self._run(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group))
        return [int(v) for v in tensor.tolist()]

    def barrier(self) -> None:
        if self.group is not None:
            self._run(lambda: dist.barrier(group=self.group))

    def _run(self, collective: Callable[[], object]) -> None:
        if self.broken is not None:
            raise GroupBrokenError(f"The {self.name} group is broken ({self.broken}); no rank waits on it any more")
        try:
            collective()
        except Exception as exc:
            self.broken = describe(exc)
            raise GroupBrokenError(
                f"The {self.name} group broke ({self.broken}): another rank died, hung or left; this rank stops "
                "using the group"
            ) from exc


def _pickled(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        return None
    return data


def _revive(outcome: _Outcome, rank: int) -> Exception:
    if outcome.error is not None:
        exc = pickle.loads(outcome.error)
        if isinstance(exc, Exception):
            return exc
    return CheckpointError(f"Failed on rank {rank}: {outcome.text}", rank=rank)


class Groups:
    """The checkpoint channels; creating them is collective, so every rank must construct this.

    Args:
        timeout_s: Timeout of every checkpoint collective.
        node: This rank's :func:`node_identity`; ranks with equal ones form a node of the topology.
    """

    def __init__(self, timeout_s: float, node: str):
        names = ("checkpoint control", "checkpoint writer", "checkpoint upload")
        if is_distributed():
            timeout = timedelta(seconds=timeout_s)
            groups = [dist.new_group(backend="gloo", timeout=timeout) for _ in names]
            self.topology = Topology(dist.get_rank(), dist.get_world_size(), [], [])
        else:
            groups = [None] * len(names)
            self.topology = Topology(0, 1, [], [])
        self.control, self.writer, self.upload = (Channel(g, n) for g, n in zip(groups, names, strict=True))
        gathered = self.control.all_gather((socket.gethostname(), node))
        self.topology.hosts = [host for host, _ in gathered]
        self.topology.nodes = [identity for _, identity in gathered]
