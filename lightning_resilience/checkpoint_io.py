"""``ResilientCheckpointIO``: Lightning's CheckpointIO plugin, backed by the async sharded engine.

Lightning hands a CheckpointIO only a dict and a path; it never says which Trainer is calling or whether a
fit is running. Both matter here: a save inside ``fit()`` is asynchronous, one after it must be on disk when
it returns, and the pack's own saves need the Trainer to build the state. So the pack tells the plugin its
Trainer from Lightning's own hooks (:meth:`ResilientCheckpointIO.bind`):

* the pack's strategies in ``connect`` (the start of every run, before any load) and in each save;
* the pack's callbacks in ``setup`` (every stage, before any load) and ``on_save_checkpoint`` (before every
  full save, also ``Trainer.save_checkpoint`` after ``fit()``).

The plugin's ``teardown``, which Lightning calls at the end of every run, unbinds it. A plugin used alone, with
Lightning's own strategy and no callback of the pack, binds itself to the Trainer whose strategy calls it
(:meth:`ResilientCheckpointIO._calling_trainer`), so it too saves in the background inside a fit, as Lightning's
AsyncCheckpointIO does. A plugin nobody bound and no strategy calls cannot tell a save inside a fit from one
after it, so it takes the safe side: each save returns once its step is committed and its file written, and a
weights-only one is written as Lightning writes it, without becoming a step a resume could take for a full
checkpoint. The bound Trainer's loggers receive the pack's metrics and its hooks drive the training session.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import weakref
from collections.abc import Collection
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_resilience.lightning_state import boundary_snapshot, full_state, is_fitting, log_to, split_checkpoint
from resilience import CheckpointConfig, CheckpointManager, NoCheckpointError
from resilience import env_settings as env
from resilience.checkpoint.rng import restore_rng
from resilience.checkpoint.staging import barrier_for
from resilience.checkpoint.tree import tensor_bytes
from resilience.config import (
    OnUploadError,
    PersistSetting,
    StagingBarrier,
    VerifyLevel,
    WhenBusy,
    auto_persist,
    auto_persist_for_bytes,
    persist_until_known,
)
from resilience.dist import first_process_of_node, is_distributed
from resilience.docstrings import documented_by
from resilience.formats.lightning_ckpt import is_weights_only, merge_checkpoint, saved_at_epoch_end
from resilience.formats.names import FILE, SHARDED, NameWriter, publish, remove, repaired_writer, resolve
from resilience.logs import route_through
from resilience.persist.fork_server import start_server_early, stop_early_server
from resilience.recovery.peer_loss import PeerLossConfig
from resilience.session import SaveState, TrainingSession
from resilience.storage.tiers import LocalTier

_LIVE: weakref.WeakSet[ResilientCheckpointIO] = weakref.WeakSet()


@documented_by(
    CheckpointConfig,
    PeerLossConfig,
    renamed={"survivor_saves": "enabled"},
    own={
        "sync_names_below_mb": "A checkpoint with less tensor data than this gets its file before ``save_checkpoint`` "
        "returns (after the commit), so small runs see Lightning's own timing; larger ones get it in the background."
    },
    notes={
        "local_root": "One run per directory.",
        "survivor_saves": "Needs one of the pack's callbacks.",
        "persist": 'Or ``"auto"``, the default: ``"thread"`` for one process with a model under 4 MiB, else '
        '``"process"`` (:func:`resilience.config.auto_persist` says why).',
    },
)
class ResilientCheckpointIO(CheckpointIO):
    """Saves Lightning checkpoints asynchronously and in parallel from every rank, with a commit protocol.

    Each save is staged into reused host buffers (the only time the training loop waits), written by a
    background thread with torch.distributed.checkpoint into ``<local_root>/step-<global_step>/``, committed
    by a manifest, and uploaded to ``durable_url``. The path Lightning asks for becomes an ordinary Lightning
    checkpoint file, written from the committed step in the background (``load_from_checkpoint``,
    ``torch.load`` and Trainers without this plugin read it). A save outside ``fit()`` returns once committed
    and its file written. Under DDP use ``strategy="resilient_ddp"`` so every rank writes its part. Used alone
    with Lightning's own strategy (no callback of the pack), the plugin is never told that a fit is running,
    so every save returns once committed and its file written: add one of the pack's callbacks
    (``AutoResume``) for asynchronous saves.

    Args:
        local_root: Directory of the fast tier (node-local NVMe, or a shared file system). Each checkpoint is
            written to ``<local_root>/step-<N>/`` and counts once its ``manifest.json`` is there. One run per
            directory.
        durable_url: Optional fsspec URL of the durable tier (``s3://bucket/run``, ``gs://...``, ``file:///...``,
            ``memory://...``). Committed local checkpoints are uploaded there in the background.
        storage_options: Keyword arguments for the durable tier's fsspec filesystem (``endpoint_url``, ``key``,
            ...). They are never written to logs, manifests or reports.
        keep_last: How many newest committed checkpoints each tier keeps (at least 2: the newest may still be
            uploading or be the one a crash interrupts).
        keep_every: Also keep every checkpoint whose step is a multiple of this (milestones).
        async_staging: Copy the state to host memory in the background. Until the copy is done, the next
            ``optimizer.step()`` (of any optimizer) first waits for it, through a global optimizer pre-step hook
            that exists only while a copy is pending; callers may also call ``wait_for_staging()`` themselves.
        staging_barrier: Where that wait happens: ``"optimizer_step"`` (copy overlaps forward and backward; the
            torchtitan pattern), ``"forward"`` (before the next module forward, for models whose forward changes
            saved state, such as BatchNorm running statistics), or ``"auto"``: ``"forward"`` when the framework
            adapter sees such a module in the model, else ``"optimizer_step"``.
        when_busy: What a save does while the previous one is still being staged or written: ``"wait"`` for it, or
            ``"skip"`` the new one (counted and warned).
        verify: What discovery checks before it trusts a checkpoint: ``"size"`` (every file present with its size,
            and checksums of the small pickled/JSON files), ``"full"`` (checksums of every file), or ``"auto"``:
            full from the local tier (a flipped bit in a shard would otherwise load as a wrong number), except for
            shards this node hashed at commit and nothing has written, replaced or renamed since (its recorded inode
            and change time prove it; ``"full"`` hashes them anyway, for bits flipped underneath the file system);
            from the durable one sizes first, then each shard hashed as it is read, before DCP parses it (a full
            check first would download every shard twice).
        fsync: Flush shards and manifest to stable storage before the local commit.
        direct_io: Write shards to the local tier with ``O_DIRECT``, past the page cache, from a few reused aligned
            buffers (hashed as they go out, so the commit reads nothing back). A buffered write of the state costs
            the kernel page-cache pages to allocate and reclaim, seconds of system CPU per save at gigabytes, on the
            cores training uses. The price: a resume on the same node reads from the device, not from memory. Where
            the file system refuses ``O_DIRECT``, writes are buffered.
        upload_concurrency: Files uploaded at once per rank.
        upload_retries: Attempts per file beyond the first before the upload fails.
        upload_backoff_s: First retry delay; doubles per attempt (with jitter), capped at 30 s.
        on_upload_error: ``"raise"`` stops training at the next save with the upload's error; ``"warn"`` keeps
            training on the local tier and logs the error.
        allow_pickle: Load state values that could only be saved as pickles. Off by default: a pickle from storage
            runs code when loaded.
        local_shared: Whether every rank sees the same ``local_root`` (auto: all ranks on one machine, with one
            directory; ranks that write to different directories are different nodes, whatever their hostnames).
        peer_copies: With node-local disks and a durable tier: after each durable commit, copy every rank's files
            into the memory of a server on the next node, so a node lost whole is restored from its peers rather
            than the durable tier. Costs each node, in host memory, its partner node's share of one checkpoint.
        collective_timeout_s: Timeout of the gloo groups the checkpoint collectives run on.
        sync_names_below_mb: A checkpoint with less tensor data than this gets its file before ``save_checkpoint``
            returns (after the commit), so small runs see Lightning's own timing; larger ones get it in the
            background.
        persist: Where the background half of a save runs (DCP write, checksums, commit, upload, retention):
            ``"process"``, a helper process per rank reading the staged state from shared memory, so none of it
            competes with the training thread for the interpreter lock; or ``"thread"``, threads of the training
            process (no shared memory needed). Or ``"auto"``, the default: ``"thread"`` for one process with a model
            under 4 MiB, else ``"process"`` (:func:`resilience.config.auto_persist` says why).
        survivor_saves: When a rank dies or hangs, the healthy ranks commit the last completed step from their
            replicas and exit (needs a local tier every rank sees). Needs one of the pack's callbacks.
    """

    def __init__(
        self,
        local_root: str = "checkpoints",
        durable_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        keep_last: int = 3,
        keep_every: int | None = None,
        async_staging: bool = False,
        staging_barrier: StagingBarrier = "auto",
        when_busy: WhenBusy = "wait",
        verify: VerifyLevel = "auto",
        fsync: bool = True,
        direct_io: bool = True,
        upload_concurrency: int = 8,
        upload_retries: int = 5,
        upload_backoff_s: float = 0.5,
        on_upload_error: OnUploadError = "raise",
        allow_pickle: bool = False,
        local_shared: bool | None = None,
        peer_copies: bool = True,
        collective_timeout_s: float = 600.0,
        sync_names_below_mb: float = 64.0,
        persist: PersistSetting = "auto",
        survivor_saves: bool = True,
    ) -> None:
        root, options = LocalTier(local_root).root, dict(storage_options or {})
        engine_persist = persist_until_known(persist)  # "auto" is settled when the engine starts (_engine)
        self.config = env.pick(
            CheckpointConfig, locals(), local_root=root, storage_options=options, persist=engine_persist
        )
        self.persist = persist
        self.survivor_saves = survivor_saves
        if self.config.persist == "process":
            start_server_early()
        if first_process_of_node():  # storage problems show now, before any training, with or without AutoResume
            for tier in self.config.tiers():
                tier.check_writable()
        self._trainer: pl.Trainer | None = None  # bound by the pack's hooks; None between runs
        self._manager: CheckpointManager | None = None
        self._session: TrainingSession | None = None
        self._session_of: pl.Trainer | None = None
        # whose state each step the engine saved or loaded in this process holds: a second name for a step reuses
        # it only for the same Trainer (another Trainer sharing the plugin may reach the same step numbers)
        self._owners: weakref.WeakValueDictionary[int, pl.Trainer] = weakref.WeakValueDictionary()
        self._names: NameWriter | None = None
        self.sync_names_below_mb = sync_names_below_mb
        self.resumed_at_epoch_end = False
        self._warned_rank0_only = False
        self._warned_unbound = False
        _LIVE.add(self)
        # without a logging set-up of the user's, the pack's lines follow Lightning's logger and its level
        route_through("lightning.pytorch", lambda: rank_zero_only.rank == 0)

    # ---- the engine -----------------------------------------------------------------------------------------

    def bind(self, trainer: pl.Trainer) -> None:
        """Tell the plugin which Trainer runs it, which Lightning never does.

        The pack's strategies call it in ``connect`` and in each save, its callbacks in ``setup`` and
        ``on_save_checkpoint``; a callback of your own may call it from the same hooks, for asynchronous saves
        with Lightning's own strategy and no callback of the pack. Local and cheap: the session is made at the
        next save or load. The plugin's ``teardown`` (the end of each run) unbinds it.
        """
        self._trainer = trainer

    def _calling_trainer(self) -> pl.Trainer | None:
        """The bound Trainer; unbound, the one whose strategy is calling, which the plugin is then bound to.

        For a plugin used alone: Lightning never tells a CheckpointIO its Trainer, and no hook of the pack's runs.
        Lightning's strategies call the plugin from their own ``save_checkpoint`` and ``load_checkpoint``, so the
        caller of the method that calls this is the strategy, and its model knows its Trainer. Any other caller
        leaves the plugin unbound.
        """
        if self._trainer is None:
            strategy = sys._getframe(2).f_locals.get("self")
            if isinstance(strategy, Strategy) and strategy._checkpoint_io is self:
                self._trainer = getattr(strategy.lightning_module, "_trainer", None)
        return self._trainer

    @property
    def session(self) -> TrainingSession:
        """The training session of the bound Trainer, made at its first use on every rank together, like saves
        and loads; unbound, a session of no Trainer, which saves and loads what it is given.

        The engine lives as long as the plugin (saves after ``fit()`` continue the same run); each Trainer that
        uses the plugin gets a session of its own, whose metrics go to that Trainer's loggers.
        """
        return self._session_for(self._trainer)

    def _session_for(self, trainer: pl.Trainer | None, checkpoint: dict[str, Any] | None = None) -> TrainingSession:
        if self._session is not None and self._session_of is trainer and not self._session.ended:
            return self._session
        self._close_session()
        manager = self._engine(trainer, checkpoint)
        if trainer is None:
            session = TrainingSession(manager, _unbound_state)
        else:
            session = TrainingSession(
                manager,
                lambda step: self._owned(step, trainer, full_state(trainer)),
                is_main=trainer.is_global_zero,
                boundary=lambda step: boundary_snapshot(trainer, step),
            )
            session.add_sink(lambda metrics: log_to(trainer, metrics))
        session.use_peer_loss(PeerLossConfig(enabled=self.survivor_saves))
        self._session, self._session_of = session, trainer
        return session

    def _engine(self, trainer: pl.Trainer | None, checkpoint: dict[str, Any] | None) -> CheckpointManager:
        """The engine, made once for the plugin's life. Without a Trainer the model is unknown: the staging
        barrier that suits any model (``"forward"``), and ``persist="auto"`` settled by the size of the
        ``state_dict`` of the ``checkpoint`` being saved."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self._manager is not None and (self._manager.closed or self._manager.world_size != world):
            self._manager.close()
            self._manager = self._names = None
        if self._manager is None:
            model = trainer.lightning_module if trainer is not None else None
            if model is not None:
                config = barrier_for(self.config, [model])
            elif self.config.staging_barrier == "auto":
                config = dataclasses.replace(self.config, staging_barrier="forward")
            else:
                config = self.config
            sharded = trainer is not None and getattr(trainer.strategy, "name_layout", FILE) == SHARDED
            if self.persist == "auto" and not sharded:  # a sharded model may not be made yet
                if model is not None:
                    config = dataclasses.replace(config, persist=auto_persist([model], world))
                elif checkpoint is not None:
                    model_bytes = tensor_bytes(checkpoint.get("state_dict"))
                    config = dataclasses.replace(config, persist=auto_persist_for_bytes(model_bytes, world))
            if config.persist == "thread":
                stop_early_server()
            self._manager = CheckpointManager(config, protected_steps=self._protected_steps)
            self._names = repaired_writer(self._manager)
        return self._manager

    @property
    def manager(self) -> CheckpointManager:
        return self.session.manager

    def _owned(self, step: int, trainer: pl.Trainer, state: SaveState) -> SaveState:
        self._owners[step] = trainer
        return state

    def _protected_steps(self) -> set[int]:
        return self._names.pending_steps() if self._names is not None else set()

    # ---- CheckpointIO ---------------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: _PATH,
        storage_options: Any | None = None,
        *,
        layout: str | None = None,
    ) -> None:
        """Inside a fit of the bound Trainer: an asynchronous engine save, and the file at ``path`` once it is
        committed. Otherwise: the same engine save, and the file written at once, the way Lightning's own plugin
        writes it.

        ``layout``: given by the pack's strategies, which call this on every rank: what ``path`` becomes, a
        Lightning checkpoint file (:data:`FILE`), or Lightning's sharded checkpoint directory (:data:`SHARDED`),
        always made from the committed step. None: called by Lightning's own strategy, on rank 0 only under
        several processes.
        """
        if (fabric := _fabric().called_by(self, sys._getframe(1).f_locals.get("self"))) is not None:
            fabric.save_dict(checkpoint, path, storage_options)
            return
        trainer = self._calling_trainer()
        if layout is None and is_distributed():
            # Lightning calls a CheckpointIO on rank 0 only under this strategy (ddp_spawn hands the weights back
            # this way); a collective save would wait for ranks that never come: save as Lightning does, once.
            if not self._warned_rank0_only:
                self._warned_rank0_only = True
                rank_zero_warn(
                    "ResilientCheckpointIO is called on rank 0 only under this strategy, so each save is a plain "
                    "synchronous Lightning file written by rank 0. For asynchronous saves in which every rank "
                    "writes its own part, use strategy='resilient_ddp'."
                )
            self._plain_file(checkpoint, path, storage_options)
            return
        fitting, weights_only = is_fitting(trainer), is_weights_only(checkpoint)
        if weights_only and not (fitting or (trainer is not None and layout is not None)):
            # no Trainer known to be this save's (outside a fit only a pack strategy, binding its own at each save,
            # makes it sure): a weights-only dict must not become a step that a resume would take for a full
            # checkpoint, so it is written as Lightning writes it
            self._plain_file(checkpoint, path, storage_options)
            return
        size = tensor_bytes(checkpoint)
        if trainer is None and size >= self.sync_names_below_mb * 2**20:
            self._say_unbound()
        session = self._session_for(trainer, checkpoint)
        step, names = int(checkpoint.get("global_step", 0)), self._names
        held = session.manager.saved(step)
        if held is not None and (trainer is None or self._owners.get(step) is not trainer) and layout != SHARDED:
            # the engine holds this step from another Trainer's state, or nothing proves it is this one's: the file
            # is Lightning's own, from the dict in hand (written once, by rank 0)
            if session.is_main:
                self._plain_file(checkpoint, path, storage_options)
            return
        # small, or nothing to overlap with: the name is there when the call returns, as with Lightning's plugin
        now = not fitting or size < self.sync_names_below_mb * 2**20
        with session.blocking():
            handle = held if held is not None and self._owners.get(step) is trainer else None
            if handle is None:
                # a weights-only name is cut from a full checkpoint of its step, which also serves a resume
                if weights_only:
                    assert trainer is not None
                    state = full_state(trainer)
                else:
                    state = split_checkpoint(checkpoint, trainer)
                if trainer is not None:
                    self._owners[step] = trainer
                handle = session.save(step, state, reason="named")

            def lightnings_own(named: dict[str, Any]) -> None:  # outside fit(), as Lightning's tests expect
                TorchCheckpointIO().save_checkpoint(named, path, storage_options=storage_options)

            write = None if fitting else lightnings_own
            run_id, where = session.manager.run_id, os.fspath(path)
            publish(names, where, step, checkpoint, handle, run_id, layout or FILE, storage_options, write, now=now)
        if not fitting:  # no next step to overlap with: no helper left idling (Lightning's tests check threads)
            session.manager.rest(wait=False)

    def _say_unbound(self) -> None:
        """Once: a large save of a plugin that does not know its Trainer (called by something other than the
        Trainer's strategy: a wrapping CheckpointIO, the user's code) waits for its commit and its file, which a
        user would not expect of an asynchronous checkpoint."""
        if not self._warned_unbound:
            self._warned_unbound = True
            rank_zero_warn(
                "ResilientCheckpointIO does not know its Trainer (it is called by something other than the "
                "Trainer's strategy), so each save returns only once it is committed and its file written, as "
                "with Lightning's own plugin. Add AutoResume() or another callback of the pack to the Trainer for "
                "saves in the background."
            )

    def _plain_file(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None) -> None:
        """Lightning's own file of ``checkpoint`` at ``path``; a name recorded there before is forgotten first, so
        a load of ``path`` reads this file, not that name's step."""
        if self._names is not None:
            self._names.forget(os.fspath(path))
        TorchCheckpointIO().save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if (fabric := _fabric().called_by(self, sys._getframe(1).f_locals.get("self"))) is not None:
            return fabric.load(path, weights_only)
        self._calling_trainer()
        step, plain = self.resolve(os.fspath(path))
        if plain is not None:  # an ordinary Lightning checkpoint, e.g. to start fine-tuning from
            return TorchCheckpointIO().load_checkpoint(plain, map_location=map_location, weights_only=weights_only)
        return self.load_engine(step)

    def load_engine(self, step: int | None, *, target: Any = None, leave_out: Collection[str] = ()) -> dict[str, Any]:
        """Load ``step`` (None: the newest that verifies) from the engine, on every rank together.

        ``target``: tensors to fill in place, under their keys in Lightning's checkpoint dict (a sharded
        strategy's DTensors, which are resharded to this run's layout), or a function making them once a
        checkpoint is found; ``leave_out``: top-level keys not to read.
        """
        session = self.session
        restored = session.restore(target, step=step, leave_out=leave_out, per_rank="each rank's RNG and data position")
        if restored is None:
            where = " or ".join(tier.display(tier.root) for tier in self.config.tiers())
            raise NoCheckpointError(
                f"No committed checkpoint verifies under {where}: start without ckpt_path, or run `resilience ls`"
            )
        self.resumed_at_epoch_end = saved_at_epoch_end(restored.state)
        if self._trainer is not None:
            self._owners[restored.step] = self._trainer
        if restored.rank_state is not None:
            restore_rng(restored.rank_state["rng"])  # now, and again where the saved run stood (below, AutoResume)
        session.restored(restored, rng_at="start" if self.resumed_at_epoch_end else "next_batch")
        return merge_checkpoint(restored.state, restored.rank_state)

    def resolve(self, path: str) -> tuple[int | None, str | None]:
        """(step to load from the engine, None) or (None, path of a plain checkpoint to load as Lightning would)."""
        return resolve(path, self._names, self.config)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the name (its file); the step stays until retention, which never deletes one mid-save."""
        remove(self._names, os.fspath(path))

    def teardown(self) -> None:
        """Wait for in-flight saves, uploads and names, and raise their failures, before the Trainer (or Fabric's
        strategy) exits; the run is over, so the plugin is unbound until a hook of the next binds it."""
        self._trainer = None
        self._close_session()
        _fabric().end_all(self)

    def _close_session(self) -> None:
        """End the session (ledger, monitors); the engine is drained, and stays for saves after training."""
        session, self._session, self._session_of = self._session, None, None
        if session is None or session.ended:
            return
        try:
            if self._names is not None:
                self._names.wait()
        finally:
            session.end(close_manager=False)

    def __getstate__(self) -> dict[str, Any]:
        """A Trainer is picklable (``torch.save(trainer)``): the settings travel, the engine's threads do not."""
        state = dict(self.__dict__)
        state.update(_trainer=None, _manager=None, _session=None, _session_of=None, _names=None)
        del state["_owners"]  # made again, empty, by __setstate__ (it holds weak references)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._owners = weakref.WeakValueDictionary()
        _LIVE.add(self)


def live_checkpoint_ios() -> list[ResilientCheckpointIO]:
    return list(_LIVE)


def _unbound_state(step: int) -> SaveState:
    raise RuntimeError(
        "ResilientCheckpointIO is not bound to a Trainer, so it cannot build the state to save: the pack's "
        "callbacks and strategies bind it in their hooks"
    )


def _fabric() -> ModuleType:
    """The Fabric adapter's checkpoints, whose ``called_by`` takes the calls of Lightning Fabric's strategies.
    Imported when used: the Fabric adapter builds on this module."""
    from lightning_resilience.fabric import checkpoints

    return checkpoints
