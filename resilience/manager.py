"""One manager per process; every checkpoint goes through it in clear phases.

    save():  agree (one tiny all-reduce) -> flatten -> stage into reused host buffers -> hand off
    writer:  DCP write of this rank's shards -> checksums -> all-gather -> manifest (local commit) -> retention
    upload:  pick newest ready -> concurrent transfers with retries -> all-gather -> manifest (durable commit)
    load():  discover (both tiers) -> verify, fall back past bad ones -> DCP load with resharding

Construction and load() are collective: call them on every rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from resilience import catalog
from resilience.config import CheckpointConfig
from resilience.dist import Groups, share_of_replicated
from resilience.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    ResilienceError,
)
from resilience.loader import Restored, plan_load, rank_prefix, run_load
from resilience.manifest import MANIFEST_NAME
from resilience.pipeline import Listener, Pipeline, SaveHandle, WriteJob, remove_checkpoint
from resilience.staging import HostStager, StagingJob
from resilience.storage import Tier
from resilience.tree import flatten

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class SaveStats:
    """Counters a user or a metrics callback can read at any time."""

    saves: int = 0
    skipped: int = 0
    waited_for_previous: int = 0
    block_s: list[float] = field(default_factory=list)
    staging_wait_s: float = 0.0


class CheckpointManager:
    """Saves and loads sharded checkpoints through a fast local tier and an optional durable URL.

    Args:
        config: Where and how; see :class:`CheckpointConfig`.
        listeners: Called (from background threads) with a dict per event: ``local_commit``,
            ``durable_commit``, ``failed``, ``skipped``, ``upload_retry``, ``upload_skipped``, ``deleted``.
        protected_steps: Called (from background threads) before retention deletes anything; steps it returns
            are kept beyond ``keep_last`` (e.g. the best-k checkpoints a framework still refers to).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        listeners: list[Listener] | None = None,
        protected_steps: Callable[[], set[int]] | None = None,
    ):
        self.config = config
        self.listeners: list[Listener] = list(listeners or [])
        self.local = Tier("local", config.local_root)
        self.durable = Tier("durable", config.durable_url, config.storage_options) if config.durable_url else None
        self.local.check_writable()
        self.groups = Groups(config.collective_timeout_s)
        self.topology = self.groups.topology
        self.rank = self.topology.rank
        self.world_size = self.topology.world_size
        self.local_shared = config.local_shared if config.local_shared is not None else self.topology.single_host
        self._startup_checks()
        self.stats = SaveStats()
        self._stager = HostStager(config.pin_memory)
        self._staging: StagingJob | None = None
        self._barrier_hooks: list[RemovableHandle] = []
        self._inflight: SaveHandle | None = None
        self._committed_lock = threading.Lock()
        self.pipeline = Pipeline(
            config,
            self.local,
            self.durable,
            self.topology,
            self.groups.writer,
            self.groups.upload,
            self.local_shared,
            self.listeners,
            self._note_committed,
            protected_steps or set,
        )
        self._closed = False

    # ---- start-up ----------------------------------------------------------------------------------------------

    def _startup_checks(self) -> None:
        """Check the durable tier once (rank 0), learn which steps exist, and clear local leftovers."""
        problem: str | None = None
        known: set[int] = set()
        if self.rank == 0:
            try:
                if self.durable is not None:
                    self.durable.check_writable()
                    known |= {e.step for e in catalog.scan(self.durable) if e.committed}
                known |= {e.step for e in catalog.scan(self.local) if e.committed}
            except Exception as exc:
                problem = str(exc)
        problem, known = self.groups.control.broadcast((problem, known))
        if problem:
            raise ConfigError(problem)
        self._known_steps: set[int] = set(known)
        self._clear_local_leftovers()

    def _clear_local_leftovers(self) -> None:
        """Remove uncommitted step directories a crashed run left behind; a later save may need the name."""
        leader = self.rank == 0 if self.local_shared else self.rank == min(self.topology.ranks_on_my_host())
        if leader:
            for entry in catalog.scan(self.local):
                if entry.problem == catalog.NOT_COMMITTED:
                    log.info("removing uncommitted leftover %s", entry.where())
                    self.local.remove_dir(entry.path)
        self.groups.control.barrier()

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is committed or being saved (in either tier)."""
        with self._committed_lock:
            return step in self._known_steps

    def _note_committed(self, step: int) -> None:
        with self._committed_lock:
            self._known_steps.add(step)

    # ---- save ----------------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        rank_state: Any = None,
        *,
        extra: dict[str, Any] | None = None,
    ) -> SaveHandle | None:
        """Stage ``state`` and return; the rest happens in the background. Call on every rank.

        ``state`` is the same tree on every rank (plain tensors are written once, by one of the ranks holding
        them; DTensor shards by their owners). ``rank_state`` differs per rank (RNG, data loader position)
        and is kept per rank. ``extra`` is JSON stored in the manifest. Returns None when the save was
        skipped because the previous one was still running and ``when_busy="skip"``.
        """
        t0 = time.monotonic()
        self._check_open()
        if step < 0:
            raise ValueError(f"step={step}: checkpoint steps are non-negative integers")
        if step in self._known_steps:
            raise CheckpointExistsError(
                f"Step {step} is already saved or being saved under {self.local.url}"
                f"{' or ' + self.durable.url if self.durable else ''}; committed checkpoints are never overwritten. "
                "Resume from it, save under a new step, or point local_root/durable_url at a new run directory"
            )
        busy = self._inflight is not None and not self._inflight._local.is_set()
        errors = self.pipeline.take_errors()
        any_error, any_busy = self.groups.control.max([int(bool(errors)), int(busy)])
        if any_error:
            raise (
                errors[0]
                if errors
                else CheckpointError(
                    "A checkpoint failed on another rank (see that rank's log); stopping so no rank runs ahead",
                    step=step,
                )
            )
        if any_busy:
            if self.config.when_busy == "skip":
                self.stats.skipped += 1
                log.warning(
                    "Skipping the save of step %s: the save of step %s is still being written (when_busy='skip'; "
                    "%d skipped so far). Save less often, or use when_busy='wait'.",
                    step,
                    self._inflight.step if self._inflight else "?",
                    self.stats.skipped,
                )
                self._emit("skipped", step)
                return None
            self.stats.waited_for_previous += 1
            assert self._inflight is not None
            self._inflight._local.wait()
        self.wait_for_staging()
        flat = flatten(state)
        rank_flat = flatten(rank_state, prefix=rank_prefix(self.rank)) if rank_state is not None else None
        shared = share_of_replicated(flat.tensors, self.rank, self.world_size)
        tensors = {**shared, **(rank_flat.tensors if rank_flat else {})}
        staging = self._stager.stage(tensors, asynchronous=self.config.async_staging)
        handle = SaveHandle(step, durable=self.durable is not None)
        block_s = time.monotonic() - t0
        handle.timings["block_s"] = block_s
        self._known_steps.add(step)
        self.pipeline.submit(
            WriteJob(
                step=step,
                staging=staging,
                skeleton=flat.skeleton,
                rank_skeleton=rank_flat.skeleton if rank_flat else None,
                pickled=flat.pickled + (rank_flat.pickled if rank_flat else []),
                extra=dict(extra or {}),
                handle=handle,
                block_s=block_s,
            )
        )
        if flat.pickled and self.stats.saves == 0:
            log.warning(
                "State values at %s are not JSON-expressible and were pickled; loading them will need "
                "allow_pickle=True",
                flat.pickled[:5],
            )
        if self.config.async_staging:
            self._staging = staging
            self._arm_staging_barrier()
        self._inflight = handle
        self.stats.saves += 1
        self.stats.block_s.append(block_s)
        return handle

    def wait_for_staging(self) -> None:
        """With ``async_staging``: return once the state may be changed again (call before ``optimizer.step()``)."""
        if self._staging is not None:
            t0 = time.monotonic()
            self._staging.release_source()
            self.stats.staging_wait_s += time.monotonic() - t0
            self._staging = None

    def _arm_staging_barrier(self) -> None:
        """Make the next state change wait for the pending copy, without the caller having to remember.

        The hooks are global; they are put in place with the copy and removed at the next save or at close (not
        from inside a hook, while torch walks its hook table), and do nothing once the copy is done. A step given
        a closure (Lightning's, LBFGS) runs forward and backward inside ``optimizer.step``: the wait then goes
        after the closure, just before the update, so the copy still overlaps them.
        """
        self._disarm_staging_barrier()

        def before_forward(*_: Any) -> None:
            self.wait_for_staging()

        def before_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self._staging is None:
                return None
            # args are step()'s own: (optimizer, closure?)
            closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
            if closure is None:
                self.wait_for_staging()
                return None

            def closure_then_wait() -> Any:
                result = closure()
                self.wait_for_staging()
                return result

            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_then_wait}
            return (args[0], closure_then_wait, *args[2:]), kwargs

        if self.config.staging_barrier == "forward":
            self._barrier_hooks.append(register_module_forward_pre_hook(before_forward))
        self._barrier_hooks.append(register_optimizer_step_pre_hook(before_step))

    def _disarm_staging_barrier(self) -> None:
        for hook in self._barrier_hooks:
            hook.remove()
        self._barrier_hooks = []

    def wait(self, timeout: float | None = None, *, durable: bool = False) -> bool:
        """Wait until the last save is committed locally (and durably with ``durable``); raise its error."""
        handle = self._inflight
        if handle is None:
            return True
        try:
            ok = handle.wait_durable(timeout) if durable else handle.wait_local(timeout)
        except CheckpointError as exc:
            self.pipeline.discard_error(exc)  # raised here; not again at the next save
            raise
        self._raise_pending()
        return ok

    def check(self) -> None:
        """Raise the first background failure not yet raised (also done by every save)."""
        self._raise_pending()

    def _raise_pending(self) -> None:
        errors = self.pipeline.take_errors()
        if errors:
            raise errors[0]

    # ---- discovery and load --------------------------------------------------------------------------------------

    def latest(self) -> catalog.Entry | None:
        """The newest committed checkpoint that verifies, agreed by all ranks (collective)."""
        return self._choose(None)

    def load(
        self,
        target: Any = None,
        *,
        step: int | None = None,
        rank_state: bool = True,
    ) -> Restored | None:
        """Load the newest verified checkpoint (or ``step``) into ``target``; None if there is none.

        Collective. ``target`` is a state tree with tensors (DTensors are resharded); without it, tensors are
        allocated on CPU. With ``step`` given and no such verified checkpoint, raises NoCheckpointError.
        """
        self._check_open()
        entry = self._choose(step)
        if entry is None:
            if step is not None:
                raise NoCheckpointError(
                    f"No committed checkpoint of step {step} verifies under {self.local.url}"
                    f"{' or ' + self.durable.url if self.durable else ''}: run `resilience ls` to see what exists"
                )
            return None
        allow_pickle = self.config.allow_pickle or os.environ.get("RESILIENCE_ALLOW_PICKLE") == "1"
        # A problem on one rank (say, its own state file) must stop every rank, not leave the others waiting
        # in the collective read: each phase ends with the ranks agreeing on its outcome.
        plan = self._together(lambda: plan_load(entry, target, rank=self.rank, want_rank_state=rank_state))
        return self._together(lambda: run_load(entry, plan, group=self.groups.control.group, allow_pickle=allow_pickle))

    def _together(self, phase: Callable[[], T]) -> T:
        """Run ``phase`` on every rank; if it failed anywhere, raise everywhere (this rank's own error first)."""
        result: T | None = None
        error: ResilienceError | None = None
        try:
            result = phase()
        except ResilienceError as exc:
            error = exc
        failures = [
            (r, text) for r, text in enumerate(self.groups.control.all_gather(str(error) if error else None)) if text
        ]
        if error is not None:
            raise error
        if failures:
            rank, text = failures[0]
            raise CheckpointError(f"Loading failed on rank {rank}: {text}")
        return result  # type: ignore[return-value]

    def _choose(self, step: int | None) -> catalog.Entry | None:
        found: list[tuple[str, int, str, Any, str | None]] = []
        if self.rank == 0:
            found = [
                (e.tier.name, e.step, e.path, e.manifest, e.problem)
                for e in catalog.candidates([self.local, self.durable], invalid=True)
                if step is None or e.step == step
            ]
        # Rank 0 lists once; every rank verifies a share of the files, so a full check scales with ranks.
        tiers = {"local": self.local, "durable": self.durable}
        entries = [
            catalog.Entry(s, tier, path, manifest, problem)
            for name, s, path, manifest, problem in self.groups.control.broadcast(found)
            if (tier := tiers[name]) is not None
        ]
        share = (self.rank, self.world_size)
        return catalog.first_verified(entries, lambda e: self._verify_together(e, share), self._warn)

    def _verify_together(self, entry: catalog.Entry, share: tuple[int, int]) -> str | None:
        problem: str | None = None
        corrupt = False
        try:
            full = self.config.verify == "full" or (self.config.verify == "auto" and entry.tier.name == "local")
            catalog.verify(entry, full=full, share=share)
        except CorruptCheckpointError as exc:
            problem, corrupt = str(exc), True
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        problems = self.groups.control.all_gather((problem, corrupt))
        found = [(p, c) for p, c in problems if p]
        if not found:
            return None
        if any(c for _, c in found):
            self._known_steps.discard(entry.step)
            if self.rank == 0:
                self._quarantine(entry)
        self.groups.control.barrier()
        return found[0][0]

    def _quarantine(self, entry: catalog.Entry) -> None:
        """Take a corrupt checkpoint out of discovery without deleting it.

        A local one moves to ``<local_root>/quarantine/`` (its step name may be saved again); in an object
        store, where moving a prefix is a copy of every object, only its manifest is renamed.
        """
        stamp = time.strftime("%Y%m%dT%H%M%S")
        try:
            if entry.tier.name == "local":
                self.local.fs.makedirs(self.local.path("quarantine"), exist_ok=True)
                aside = self.local.path("quarantine", f"step-{entry.step}-{stamp}")
                os.rename(entry.path, aside)
            else:
                aside = f"{entry.path}/{MANIFEST_NAME}.corrupt-{stamp}"
                entry.tier.fs.mv(f"{entry.path}/{MANIFEST_NAME}", aside)
            log.warning("quarantined corrupt %s as %s", entry.where(), entry.tier.display(aside))
        except Exception as exc:
            log.warning("could not quarantine %s: %s", entry.where(), exc)

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            warnings.warn(message, stacklevel=3)

    # ---- events and close --------------------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self.listeners.append(listener)

    def _emit(self, event: str, step: int, **fields: Any) -> None:
        self.pipeline._emit(event, step, **fields)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("This CheckpointManager is closed; make a new one")

    def close(self, timeout: float | None = None) -> None:
        """Finish every queued write and upload, then stop; raises the first background failure."""
        if self._closed:
            return
        self._closed = True
        self.wait_for_staging()
        self._disarm_staging_barrier()
        finished = self.pipeline.close(timeout)
        self._stager.close()
        # The gloo groups stay until the job's own destroy_process_group(): destroying them here could tear
        # connections down under a peer that is still finishing its last collective.
        if not finished:
            log.warning("checkpoint threads did not finish within %ss; they are left to the process exit", timeout)
        self._raise_pending()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CheckpointManager", "SaveHandle", "SaveStats", "remove_checkpoint"]
