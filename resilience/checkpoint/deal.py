"""The deal: which rank writes which tensor of a shared state, worked out alike on every rank without a message.

A normal save deals the state among every rank that writes; a survivor save (:mod:`resilience.recovery.survivors`)
among the survivors. Both flatten the same tree, split off what only the leader writes, deal the rest, and check
with a fingerprint that every rank dealt alike.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor, Replicate

from resilience.checkpoint.tree import FlatState, flatten, tree_key
from resilience.errors import CheckpointError
from resilience.storage.layout import rank_prefix


def holders(tensor: DTensor) -> list[int]:
    """The global ranks holding the same chunk of ``tensor`` as this rank (its replicas, itself included).

    A mesh dimension the tensor is replicated over (HSDP's replicate dimension, a tensor-parallel group holding a
    replicated weight) repeats the chunk on every rank along it; a shard (or partial) placement tells ranks apart.
    """
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh: it holds none of it
        return []
    index = tuple(
        slice(None) if isinstance(p, Replicate) else c for p, c in zip(tensor.placements, coordinate, strict=True)
    )
    return sorted(int(r) for r in mesh.mesh[index].flatten().tolist())


def share_among(tensors: dict[str, torch.Tensor], rank: int, writers: list[int]) -> dict[str, torch.Tensor]:
    """This rank's share when ``writers`` write (every rank, in a normal save): each replicated tensor once.

    Plain tensors (DDP's replicas) are dealt out among the writers, and each DTensor chunk among its holders that
    write (HSDP's replica groups), each to the one with the fewest bytes so far (ties to the lowest rank); a set
    of holders keeps its own count, which only its members update, in the same order. Every rank computes the
    same split from the same sizes, without a message, and stages only its share, so the copy a save blocks for
    and the host memory it copies into shrink with the number of replicas, and the replicas write equal parts.
    """
    load = dict.fromkeys(writers, 0)
    chunk_load: dict[tuple[int, ...], dict[int, int]] = {}
    mine: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            candidates = tuple(r for r in holders(tensor) if r in load)
            if not candidates:
                continue
            counts = chunk_load.setdefault(candidates, dict.fromkeys(candidates, 0))
            owner = min(candidates, key=lambda r: (counts[r], r))
            counts[owner] += tensor._local_tensor.numel() * tensor._local_tensor.element_size()
            if owner == rank:
                mine[key] = tensor
            continue
        owner = min(writers, key=lambda r: (load[r], r))
        load[owner] += tensor.numel() * tensor.element_size()
        if owner == rank:
            mine[key] = tensor
    return mine


def deal_digest(tensors: dict[str, torch.Tensor]) -> int:
    """A 62-bit fingerprint of what :func:`share_among` deals (keys, dtypes, shapes, in order), for ranks to check
    in one all-reduce that they deal alike: ranks that dealt different trees would leave some tensor unwritten."""
    described = [f"{key}\0{tensor.dtype}\0{tuple(tensor.shape)}" for key, tensor in tensors.items()]
    return xxhash.xxh3_64_intdigest("\n".join(described).encode()) >> 2


def split_by_origin(
    tensors: dict[str, torch.Tensor], replicated: Collection[str] | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(tensors dealt out among the replicas, tensors the leader writes as it holds them) of a shared state.

    ``replicated``: the top-level keys of the state whose plain tensors every rank holds alike (a DDP model and
    its optimizer), None for all of them. Plain tensors under the other keys may differ from rank to rank, in
    value and in structure (a callback's best score of a metric each rank computes on its own data, a file name
    holding it): of those, one rank's are written, the rank that writes the state's skeleton, which refers to
    them; so its own set and values come back on every rank, as Lightning keeps rank 0's checkpoint. DTensors
    are always dealt to their holders.
    """
    if replicated is None:
        return tensors, {}
    wanted = {tree_key(key) for key in replicated}
    dealt: dict[str, torch.Tensor] = {}
    leaders: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        alike = isinstance(tensor, DTensor) or key.split("/", 1)[0] in wanted
        (dealt if alike else leaders)[key] = tensor
    return dealt, leaders


def only_held_by(tensors: dict[str, torch.Tensor], ranks: set[int]) -> list[str]:
    """This rank's DTensor chunks that no rank outside ``ranks`` also holds (no replica to write them)."""
    return [k for k, t in tensors.items() if isinstance(t, DTensor) and set(holders(t)) <= ranks and holders(t)]


@dataclass
class Share:
    """What one rank stages and writes of a save."""

    tensors: dict[str, torch.Tensor]
    skeleton: Any  # the shared state's: on the leader only
    rank_flat: FlatState | None  # the rank's own state


@dataclass
class SaveTree:
    """A save's shared state, flattened and split; every rank builds the same one from the same tree."""

    flat: FlatState
    dealt: dict[str, torch.Tensor]  # dealt out among the writers
    leaders: dict[str, torch.Tensor]  # written by the leader, as it holds them
    writers: list[int]  # the ranks that do not abstain; the lowest is the leader
    abstain: list[int]
    alone: list[str]  # of this rank's DTensor chunks, those that only abstaining ranks hold

    @classmethod
    def of(cls, state: Any, world_size: int, abstain: Collection[int], replicated: Collection[str] | None) -> SaveTree:
        flat = flatten(state)
        dealt, leaders = split_by_origin(flat.tensors, replicated)
        writers = [r for r in range(world_size) if r not in set(abstain)]
        alone = only_held_by(flat.tensors, set(abstain)) if abstain else []
        return cls(flat, dealt, leaders, writers, sorted(abstain), alone)

    @property
    def digest(self) -> int:
        return deal_digest(self.dealt)

    def share(self, rank: int, rank_state: Any, unreadable: str | None) -> Share:
        """``rank``'s share of the shared state (the leader's: with what it alone writes), and its own state.
        ``unreadable``: why the rank's GPU must not be read, if it must not (then its share must be empty)."""
        rank_flat = flatten(rank_state, prefix=rank_prefix(rank)) if rank_state is not None else None
        if not self.writers:
            raise CheckpointError("every rank abstains from this save: there is no healthy replica to write it")
        leader = rank == self.writers[0]
        shared = share_among(self.dealt, rank, self.writers)
        tensors = dict(shared)
        tensors.update(self.leaders if leader else {})
        tensors.update(rank_flat.tensors if rank_flat else {})
        if (shared or (leader and self.leaders)) and unreadable:
            raise CheckpointError(
                f"rank {rank}'s GPU must not be read ({unreadable}), yet a save asked it for its share: pass the sick "
                "ranks as abstain"
            )
        return Share(tensors, self.flat.skeleton if leader else None, rank_flat)
