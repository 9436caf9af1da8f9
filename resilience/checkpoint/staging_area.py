"""The host buffers one manager stages its saves into, and everything that may still hold them.

Three things hold the buffers after a save returns: the copy into them, which may still be reading the live
state (the next state change waits for it: a barrier of hooks makes sure of that without the caller having to
remember); the save's writer, which reads them; and readers they were lent to. The next save copies into the
same buffers, so it waits for all three.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from resilience.checkpoint.save_handle import SaveHandle
from resilience.checkpoint.staging import HostStager, Loan, StagingJob
from resilience.checkpoint.updates import before_update
from resilience.config import CheckpointConfig


class StagingArea:
    """One manager's staging buffers, the copy in flight, the save they hold and the loans of them."""

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.stager = HostStager(config.pin_memory, shared=config.persist == "process")
        self.pending: StagingJob | None = None  # a copy the next state change must wait for
        self.barrier_hooks: list[RemovableHandle] = []
        self._staged: tuple[SaveHandle, StagingJob] | None = None  # the save whose values the buffers hold
        self._loans: list[Loan] = []

    def lent(self) -> list[Loan]:
        return [loan for loan in self._loans if not loan.returned.done()]

    def stage(self, handle: SaveHandle, tensors: dict[str, Any]) -> StagingJob:
        """Copy ``tensors`` into the buffers for ``handle``'s save; every loan must be back (the save waited)."""
        self._loans = []
        staging = self.stager.stage(tensors, asynchronous=self.config.async_staging)
        self._staged = (handle, staging)
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
        if self._staged is None or self._staged[0] is not handle:
            return None
        tensors = {key: t for key, t in self._staged[1].staged.items() if not isinstance(t, DTensor)}
        loan = Loan(tensors)
        self._loans.append(loan)
        return loan

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
        closing the stager unlinks."""
        concurrent.futures.wait([loan.returned for loan in self.lent()], timeout)
        self.stager.close()

    def abandon(self) -> None:
        """Let go of the live state at once (the copy into host memory is local: it ends); the buffers stay
        until :meth:`close`."""
        if self.pending is not None:
            with contextlib.suppress(Exception):
                self.pending.release_source()
            self.pending = None
        self.disarm_barrier()
