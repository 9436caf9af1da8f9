"""The training session's resume: load a step, fit its per-rank state to this run, say what came back, and
re-apply the saved RNG streams where the saved run stood.

A checkpoint's per-rank state belongs to the rank of the same number in a run of the same size; in any other
it fits no rank, and starts afresh. The RNG streams are part of it: applied at once, when training starts, or
when the next batch is in hand (a mid-epoch save was taken with the loader's iterator already made, which
draws from the RNG).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from resilience.checkpoint.loader import Restored
from resilience.checkpoint.rng import restore_rng

if TYPE_CHECKING:
    from resilience.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)
RngTiming = Literal["now", "start", "next_batch"]


class SessionResume:
    """The session's resume, from :meth:`restore` to :meth:`restored` (the adapter puts the state in place in
    between), and the saved RNG streams until they are due.

    Args:
        manager: The engine that loads.
        is_main: Whether this process says what was restored.
        on_restored: Told the restored step (None: nothing to resume), the seconds from :meth:`restore` to
            :meth:`restored`, and what the load spent them on (the goodput ledger's restore time).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        is_main: bool,
        on_restored: Callable[[int | None, float, dict[str, float]], None],
    ) -> None:
        self._manager = manager
        self._is_main = is_main
        self._on_restored = on_restored
        self._began: float | None = None
        self._pending_rng: tuple[dict[str, Any], RngTiming] | None = None

    def restore(self, target: Any, *, step: int | None, leave_out: Collection[str], per_rank: str) -> Restored | None:
        """Load ``step`` on every rank; the per-rank state only where it fits (see the module)."""
        self._began = time.perf_counter()
        manager = self._manager
        restored = manager.load(target, step=step, leave_out=leave_out)
        if restored is None:
            return None
        if restored.manifest.world_size == manager.world_size:
            lost = (restored.manifest.extra.get("survivor_save") or {}).get("lost", [])
            if restored.rank_state is None and manager.rank in lost:
                # a rank lost before its heartbeat wrote its state of this boundary (docs/HEALTH.md)
                log.warning(
                    "rank %d: step %d was saved by the survivors after this rank was lost, without its own "
                    "state of that step: %s starts afresh, so this rank's part of the run will not repeat exactly",
                    manager.rank,
                    restored.step,
                    per_rank,
                )
            return restored
        if self._is_main:
            log.warning(
                "step %d (%s) was saved by %d processes and this run has %d: the shared state is restored "
                "(resharded), but %s starts afresh",
                restored.step,
                restored.path,
                restored.manifest.world_size,
                manager.world_size,
                per_rank,
            )
        return replace(restored, rank_state=None)

    def restored(self, restored: Restored | None, *, rng_at: RngTiming, position: str) -> None:
        """The state is in place (or nothing was found): the time since :meth:`restore`, what came back, and
        the saved RNG streams, applied now or kept until ``rng_at``."""
        began, self._began = self._began, None
        seconds = time.perf_counter() - began if began is not None else 0.0
        parts = restored.timings if restored is not None else {}
        self._on_restored(restored.step if restored is not None else None, seconds, parts)
        self._pending_rng = None
        if restored is None:
            return
        if self._is_main:
            sizes = self._manager.config.verify == "size"
            checks = "sizes and small files' checksums" if sizes else "every file's checksum"
            where = f"Restored step {restored.step} from the {restored.tier} tier ({restored.path}) in {seconds:.1f} s"
            log.info("%s, verified: %s%s", where, checks, f"; {position}" if position else "")
        saved_rng = restored.rank_state.get("rng") if isinstance(restored.rank_state, dict) else None
        if saved_rng is not None:
            self._pending_rng = (saved_rng, rng_at)
            self.rng_due("now")

    def rng_due(self, when: RngTiming) -> None:
        """Re-apply the saved RNG streams if ``when`` is where they belong."""
        if self._pending_rng is not None and self._pending_rng[1] == when:
            restore_rng(self._pending_rng[0])
            self._pending_rng = None
