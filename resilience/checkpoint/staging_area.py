"""The host buffers one manager stages its saves into, and everything that may still hold them.

Three things hold a set of buffers after a save returns: the copy into them, which may still be reading the live
state (the next state change waits for it: a barrier of hooks makes sure of that without the caller having to
remember); the save's writer, which reads them until the save is committed; and readers they were lent to. A save
copies into a set none of them holds. One set is enough while each save commits before the next, and a large
state gets no other: a second would double the host memory it takes. A small state gets more sets when those it
has are held (up to :data:`MAX_SETS`, while they come to at most :data:`SETS_BYTES` and :data:`SETS_BUFFERS`), so
that a save does not wait for the ones before it to commit: in a small job the first saves are made before the
helper process that writes them has started, and at a save every few steps a commit can take longer than those
steps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from resilience.checkpoint.save_handle import SaveHandle
from resilience.checkpoint.staging import HostStager, Loan, StagingJob, local_nbytes
from resilience.checkpoint.updates import before_update
from resilience.config import CheckpointConfig

SETS_BYTES = 64 * 2**20  # another set of buffers is made only while the sets a rank has hold at most this much
SETS_BUFFERS = 4096  # ... and at most this many buffers (each a shared-memory segment, mapped by the helper)
MAX_SETS = 8  # saves a small state may have staged at once, not yet committed


@dataclass
class BufferSet:
    """One set of buffers (one per checkpoint key), the save whose values it holds, and the loans of it."""

    stager: HostStager
    staged: tuple[SaveHandle, StagingJob] | None = None
    loans: list[Loan] = field(default_factory=list)

    def lent(self) -> list[Loan]:
        return [loan for loan in self.loans if not loan.returned.done()]

    def holders(self) -> list[concurrent.futures.Future[Any]]:
        """What must end before another save may copy into this set: its save's commit (or failure), its loans."""
        held: list[concurrent.futures.Future[Any]] = [loan.returned for loan in self.lent()]
        if self.staged is not None and not self.staged[0].committed.done():
            held.append(self.staged[0].committed)
        return held


class StagingArea:
    """One manager's staging buffers (one set, or more for a small state), the copy in flight, the saves they hold
    and the loans of them."""

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.sets = [self._new_set()]
        self.pending: StagingJob | None = None  # a copy the next state change must wait for
        self.barrier_hooks: list[RemovableHandle] = []

    def _new_set(self) -> BufferSet:
        return BufferSet(HostStager(self.config.pin_memory, shared=self.config.persist == "process"))

    def _may_add(self, nbytes: int, count: int) -> bool:
        """Whether another set may be made for a state of ``nbytes`` in ``count`` tensors on this rank."""
        sets = len(self.sets)
        return sets < MAX_SETS and sets * nbytes <= SETS_BYTES and sets * count <= SETS_BUFFERS

    def _oldest(self) -> BufferSet:
        return min(self.sets, key=lambda held: held.staged[0].step if held.staged is not None else -1)

    def busy_with(self) -> list[concurrent.futures.Future[Any]]:
        """Empty if a save may be staged now; else what it must wait for: the oldest save still held, and that
        save's loans (its set is then free). The size of the last state staged stands for the next one's."""
        first = self.sets[0].stager
        if any(not held.holders() for held in self.sets) or self._may_add(first.nbytes, first.count):
            return []
        return self._oldest().holders()

    def stage(self, handle: SaveHandle, tensors: dict[str, Any]) -> StagingJob:
        """Copy ``tensors`` into a free set of buffers for ``handle``'s save (:meth:`busy_with` was waited for):
        the first free one, else a new one if the state is small enough."""
        free = [held for held in self.sets if not held.holders()]
        first = self.sets[0].stager
        if free:
            chosen = free[0]
        elif self._may_add(max(first.nbytes, local_nbytes(tensors.values())), max(first.count, len(tensors))):
            chosen = self._new_set()
            self.sets.append(chosen)
        else:  # a state grown past what busy_with() judged by, or a loan taken since: wait here
            chosen = self._oldest()
            concurrent.futures.wait(chosen.holders())
        chosen.loans = []
        staging = chosen.stager.stage(tensors, asynchronous=self.config.async_staging)
        chosen.staged = (handle, staging)
        if not self.config.async_staging:
            handle.staged.set_result(None)
        return staging

    def hold(self, staging: StagingJob, wait: Callable[[], None]) -> None:
        """With ``async_staging``: ``staging`` still reads the live state; ``wait`` runs before it changes."""
        if self.config.async_staging:
            self.pending = staging
            self._arm_barrier(wait)

    def lend(self, handle: SaveHandle) -> Loan | None:
        """The plain tensors ``handle``'s save staged here, lent; None once the buffers hold a later save."""
        for held in self.sets:
            if held.staged is not None and held.staged[0] is handle:
                staged = held.staged[1].staged
                loan = Loan({key: t for key, t in staged.items() if not isinstance(t, DTensor)})
                held.loans.append(loan)
                return loan
        return None

    def release(self) -> None:
        """Wait until the pending copy no longer reads the live state."""
        if self.pending is not None:
            self.pending.release_source()
            self.pending = None

    def _arm_barrier(self, wait: Callable[[], None]) -> None:
        """Make the next state change wait for the pending copy, without the caller having to remember.

        The hooks are global; they are put in place with the copy and removed at the next save or at close (not
        from inside a hook, while torch walks its hook table), and do nothing once the copy is done. The wait
        comes just before the update (:mod:`resilience.checkpoint.updates`), so the copy still overlaps a closure's
        forward and backward.
        """
        self.disarm_barrier()

        def before_forward(*_: Any) -> None:
            wait()

        if self.config.staging_barrier == "forward":
            self.barrier_hooks.append(register_module_forward_pre_hook(before_forward))
        self.barrier_hooks.append(before_update(wait, active=lambda: self.pending is not None))

    def disarm_barrier(self) -> None:
        for hook in self.barrier_hooks:
            hook.remove()
        self.barrier_hooks = []

    def close(self, timeout: float | None) -> None:
        """Free the buffers once their readers are done: a reader in another process maps them by name, which
        closing a stager unlinks."""
        concurrent.futures.wait([loan.returned for held in self.sets for loan in held.lent()], timeout)
        for held in self.sets:
            held.stager.close()

    def abandon(self) -> None:
        """Let go of the live state at once (the copy into host memory is local: it ends); the buffers stay
        until :meth:`close`."""
        if self.pending is not None:
            with contextlib.suppress(Exception):
                self.pending.release_source()
            self.pending = None
        self.disarm_barrier()
