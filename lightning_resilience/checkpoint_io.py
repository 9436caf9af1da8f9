"""``ResilientCheckpointIO``: Lightning's CheckpointIO plugin, backed by the async sharded engine."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from lightning_resilience.lightning_state import merge_checkpoint, saved_at_epoch_end, split_checkpoint
from lightning_resilience.pointer import Pointer, read_pointer, remove_pointer, write_pointer
from lightning_resilience.resume_rng import PendingRNG
from resilience import CheckpointConfig, CheckpointManager, NoCheckpointError
from resilience.config import OnUploadError, VerifyLevel, WhenBusy
from resilience.rng import restore_rng
from resilience.storage import STEP_DIR, Tier

log = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[ResilientCheckpointIO] = weakref.WeakSet()


class ResilientCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints asynchronously and in parallel from every rank, with a commit protocol.

    Each save is staged into reused host buffers (the only time the training loop waits), written by a
    background thread with torch.distributed.checkpoint into ``<local_root>/step-<global_step>/``, committed
    by a manifest, and uploaded to ``durable_url``. The path Lightning asks for gets a small pointer file, so
    ``ModelCheckpoint``'s naming, top-k and ``save_last`` work unchanged. Under DDP use
    ``strategy="resilient_ddp"`` so every rank writes its part (see docs/LIGHTNING.md).

    Args:
        local_root: Fast tier directory (node-local disk, or shared storage).
        durable_url: fsspec URL every node can reach (``s3://bucket/run``, ``gs://...``, ``file:///...``).
        storage_options: fsspec options for ``durable_url`` (endpoint, credentials); never logged.
        keep_last: Newest checkpoints each tier keeps, at least 2; checkpoints a ``ModelCheckpoint`` name still
            points to (its best-k) are kept on top.
        keep_every: Also keep every checkpoint whose global step is a multiple of this.
        async_staging: Copy to host memory in the background; waits just before the next optimizer step.
        when_busy: ``"wait"`` for, or ``"skip"`` a save due while the previous is still being written.
        verify: What resume checks before trusting a checkpoint: ``"auto"`` (checksums of every file from the
            local tier, sizes from the durable one), ``"size"`` or ``"full"``.
        fsync: Flush files before the local commit.
        upload_concurrency: Files uploaded at once per rank.
        upload_retries: Retries per file (exponential backoff) before the upload fails.
        on_upload_error: ``"raise"`` stops training at the next save; ``"warn"`` keeps training on the local tier.
        allow_pickle: Allow loading values that had to be pickled (e.g. custom objects in ``hyper_parameters``).
        local_shared: Whether ``local_root`` is one file system all nodes see (default: only on a single host).
    """

    def __init__(
        self,
        local_root: str = "checkpoints",
        durable_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        async_staging: bool = False,
        when_busy: WhenBusy = "wait",
        verify: VerifyLevel = "auto",
        fsync: bool = True,
        upload_concurrency: int = 8,
        upload_retries: int = 5,
        on_upload_error: OnUploadError = "raise",
        allow_pickle: bool = False,
        local_shared: bool | None = None,
    ) -> None:
        self.config = CheckpointConfig(
            local_root=os.path.abspath(local_root),
            durable_url=durable_url,
            storage_options=dict(storage_options or {}),
            keep_last=keep_last,
            keep_every=keep_every,
            async_staging=async_staging,
            when_busy=when_busy,
            verify=verify,
            fsync=fsync,
            upload_concurrency=upload_concurrency,
            upload_retries=upload_retries,
            on_upload_error=on_upload_error,
            allow_pickle=allow_pickle,
            local_shared=local_shared,
        )
        self._manager: CheckpointManager | None = None
        self._aliases: dict[str, int] = {}
        self._aliases_lock = threading.Lock()
        self.collective = False  # set by ResilientDDPStrategy, which calls save on every rank
        self.pending_rng: PendingRNG | None = None
        self.stall_s = 0.0  # training-thread time spent in saves so far (for goodput accounting)
        self.last_restore: tuple[int, float] | None = None  # (step, seconds) of the last load
        self.listeners: list[Any] = []
        _LIVE.add(self)

    # ---- the engine -----------------------------------------------------------------------------------------

    @property
    def manager(self) -> CheckpointManager:
        """The engine, created on first use; creation is collective, like every save and load that uses it."""
        if self._manager is None:
            self._manager = CheckpointManager(self.config, self.listeners, protected_steps=self._referenced_steps)
        return self._manager

    def _referenced_steps(self) -> set[int]:
        with self._aliases_lock:
            return set(self._aliases.values())

    def remember_alias(self, path: _PATH) -> None:
        """Protect the checkpoint a pointer (from an earlier run) names, e.g. a restored best-k path."""
        pointer = read_pointer(path)
        if pointer is not None and pointer.step is not None:
            with self._aliases_lock:
                self._aliases[os.fspath(path)] = pointer.step

    def pointer(self, select: str = "latest", step: int | None = None) -> Pointer:
        return Pointer(select, step, self.config.local_root, self.config.durable_url)  # type: ignore[arg-type]

    # ---- CheckpointIO ---------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "ResilientCheckpointIO does not take storage_options per save; configure durable_url and "
                "storage_options on the plugin instead"
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not self.collective:
            raise RuntimeError(
                "ResilientCheckpointIO was called on one rank only: with several processes use "
                "strategy='resilient_ddp' (or ResilientDDPStrategy), which lets every rank write its part"
            )
        start = time.perf_counter()
        step = int(checkpoint.get("global_step", 0))
        manager = self.manager
        if not manager.has_step(step):  # a second name for a step already saved only gets a pointer
            shared, rank_state = split_checkpoint(checkpoint)
            extra = {k: checkpoint[k] for k in ("epoch", "global_step") if isinstance(checkpoint.get(k), int)}
            manager.save(step, shared, rank_state, extra=extra)
        with self._aliases_lock:
            self._aliases[os.fspath(path)] = step
        if manager.rank == 0:
            write_pointer(path, self.pointer("step", step))
        self.stall_s += time.perf_counter() - start

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        pointer = read_pointer(path)
        step: int | None
        if pointer is not None:
            self._check_same_run(path, pointer)
            step = pointer.step if pointer.select == "step" else None
        elif (match := STEP_DIR.match(os.path.basename(os.fspath(path).rstrip("/")))) is not None:
            step = int(match.group(1))
        else:  # a plain Lightning checkpoint, e.g. to start fine-tuning from
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        start = time.perf_counter()
        restored = self.manager.load(step=step)
        if restored is None:
            raise NoCheckpointError(
                f"No committed checkpoint verifies under {self.config.local_root}"
                f"{' or ' + self.config.durable_url if self.config.durable_url else ''}: "
                "start without ckpt_path, or run `resilience ls` to see what is there"
            )
        self.pending_rng = None
        if restored.rank_state is not None:
            rng = restored.rank_state["rng"]
            restore_rng(rng)  # AutoResume re-applies it at the exact point the saved run had reached
            self.pending_rng = PendingRNG(rng, saved_at_epoch_end(restored.state))
        self.last_restore = (restored.step, time.perf_counter() - start)
        log.info("restored step %s from the %s tier (%s)", restored.step, restored.tier, restored.path)
        return merge_checkpoint(restored.state, restored.rank_state)

    def _check_same_run(self, path: _PATH, pointer: Pointer) -> None:
        ours = Tier("local", self.config.local_root).root
        if Tier("local", pointer.local_root).root != ours and pointer.durable_url != self.config.durable_url:
            raise ValueError(
                f"{path} points to checkpoints under {pointer.local_root} / {pointer.durable_url}, but this "
                f"plugin uses {self.config.local_root} / {self.config.durable_url}: configure the plugin with "
                "that run's local_root and durable_url to load it"
            )

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the name only; the data goes once no name refers to it and retention allows (never mid-save)."""
        with self._aliases_lock:
            self._aliases.pop(os.fspath(path), None)
        remove_pointer(path)

    def teardown(self) -> None:
        """Wait for in-flight saves and uploads, and raise their failures, before the Trainer exits."""
        if self._manager is not None:
            manager, self._manager = self._manager, None
            manager.close()


def live_checkpoint_ios() -> list[ResilientCheckpointIO]:
    return list(_LIVE)
