"""Process groups for checkpoint collectives, and collectives that degrade to no-ops in one process.

Checkpoint collectives run on gloo groups of their own, one per thread that issues them: the training thread
(control), the writer thread and the uploader thread. Collectives on the training job's default group from a
background thread deadlock against the job's own all-reduces, and two threads sharing one group can
interleave their collectives differently on different ranks.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

T = TypeVar("T")

# DCP warns on every single-process save/load; the engine chooses single-process mode on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass
class Topology:
    rank: int
    world_size: int
    hosts: list[str]

    @property
    def host(self) -> str:
        return self.hosts[self.rank]

    def ranks_on_my_host(self) -> list[int]:
        return [r for r, h in enumerate(self.hosts) if h == self.host]

    @property
    def single_host(self) -> bool:
        return len(set(self.hosts)) == 1


def share_of_replicated(tensors: Mapping[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The tensors this rank copies and writes: its share of the plain ones, and all of its DTensor shards.

    Plain tensors of a shared state are the same on every rank (DDP's replicas), so each needs copying and
    writing once, not once per rank. They are dealt out in order, each to the rank with the fewest bytes so far
    (ties to the lowest rank): every rank computes the same split from the same sizes, without a message, and
    stages only its share, so the copy a save blocks for shrinks with the number of ranks.
    """
    if world_size == 1:
        return dict(tensors)
    load = [0] * world_size
    mine: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            mine[key] = tensor
            continue
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += tensor.numel() * tensor.element_size()
        if owner == rank:
            mine[key] = tensor
    return mine


class Channel:
    """Collectives over one gloo group, or trivial answers when there is only one process."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    @property
    def active(self) -> bool:
        return self.group is not None

    def all_gather(self, obj: T) -> list[T]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: T, src: int = 0) -> T:
        if self.group is None:
            return obj
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def max(self, values: list[int]) -> list[int]:
        """Element-wise maximum across ranks: one small tensor all-reduce, cheap enough for every save."""
        if self.group is None:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in tensor.tolist()]

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)


class Groups:
    """The three checkpoint channels; creating them is collective, so every rank must construct this."""

    def __init__(self, timeout_s: float):
        if is_distributed():
            timeout = timedelta(seconds=timeout_s)
            groups = [dist.new_group(backend="gloo", timeout=timeout) for _ in range(3)]
            self.topology = Topology(dist.get_rank(), dist.get_world_size(), [])
        else:
            groups = [None, None, None]
            self.topology = Topology(0, 1, [])
        self.control, self.writer, self.upload = (Channel(g) for g in groups)
        self.topology.hosts = self.control.all_gather(socket.gethostname())
