"""The pack's checkpoints for one Lightning Fabric strategy: ``fabric.save`` and ``fabric.load`` through the engine.

Fabric saves and loads through its strategy. ``Strategy.save_checkpoint`` turns modules, optimizers and other
stateful objects into their state dicts and hands the dict to the CheckpointIO (on rank 0 only under DDP, hence
the pack's strategy, ``strategy.py``); ``Strategy.load_checkpoint`` asks the CheckpointIO for the dict at a path and
puts it back into the objects in place. Here a save is staged into host memory, then written, committed and
uploaded in the background; its path becomes an ordinary ``torch.save`` file of the same dict, written from the
committed step (``torch.load`` and a Fabric without the pack read it). A load of that path, of a ``step-<N>``
folder, or :func:`~lightning_resilience.fabric.resume`'s of the newest checkpoint, is verified, reshards to this run's
processes and puts each rank's RNG back. Any other file loads as Fabric loads it.

Fabric has no training loop of its own, so what the other adapters take from theirs comes from elsewhere:

* checkpoint numbers are the steps of the first optimizer the pack sees, counted by a hook on it, and moved past
  the last save when saves come between two steps (:class:`CheckpointNumbers`): every save keeps the state as it
  is at the call;
* what the session saves by itself (emergency and survivor saves) is the dict given to ``resume``, the line before
  the loop;
* the step boundary is the user's ``fabric.call("on_train_batch_end")``, which the pack's callbacks answer.

A dict without an optimizer (weights for inference, an export) makes no step: it is written as Fabric writes it,
so a resume never takes it for the training state.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.strategies import Strategy
from lightning.fabric.utilities.types import _PATH
from lightning.fabric.wrappers import _unwrap_objects
from torch.nn import Module
from torch.optim import Optimizer

from resilience.checkpoint.loader import Restored
from resilience.checkpoint.manager import CheckpointManager
from resilience.checkpoint.numbering import CheckpointNumbers
from resilience.checkpoint.rng import capture_rng
from resilience.checkpoint.staging import barrier_for
from resilience.checkpoint.tree import flatten, tensor_bytes
from resilience.config import CheckpointConfig, auto_persist, auto_persist_for_bytes
from resilience.dist import is_distributed
from resilience.errors import ConfigError, NoCheckpointError
from resilience.formats.names import FILE, NameWriter, publish, repaired_writer, resolve
from resilience.persist.fork_server import stop_early_server
from resilience.recovery.peer_loss import PeerLossConfig
from resilience.session import SaveState, TrainingSession

if TYPE_CHECKING:
    from lightning_resilience.checkpoint_io import ResilientCheckpointIO

log = logging.getLogger(__name__)
PER_RANK = "each rank's RNG"
# A strategy's checkpoints are an attribute of the strategy: they hold it (and the user's state, which holds it
# too), so a mapping from strategies to them would keep every strategy alive, with its engine's host buffers.
_ATTRIBUTE = "_resilient_checkpoints"
_LIVE: weakref.WeakSet[FabricCheckpoints] = weakref.WeakSet()


class FabricCheckpoints:
    """Saves, loads and the training session of one Fabric strategy, through its ``ResilientCheckpointIO``'s
    settings. Made by :func:`serve` (the pack's strategy) or at the first call of Fabric's own strategy on one
    process; the engine is made at the first save, load or callback set-up, on every rank together."""

    def __init__(self, strategy: Strategy, io: ResilientCheckpointIO) -> None:
        self.strategy = strategy
        self.io = io
        self.numbers = CheckpointNumbers()
        self.training_state: dict[str, Any] | None = None  # resume()'s dict: what the session saves by itself
        self.fabric: Any = None  # told by the pack's callbacks: the metrics go to its loggers
        self._sized_by: Mapping[str, Any] | None = None  # a state whose modules settle the engine's "auto" settings
        self._counting = False  # whether the first optimizer's steps are counted
        self._manager: CheckpointManager | None = None
        self._names: NameWriter | None = None
        self._session: TrainingSession | None = None
        self._held: Restored | None = None  # resume()'s step, for the fabric.load that puts it in place
        self._boundary_steps = 0  # optimizer steps at the last step boundary
        self._last_number = 0  # the checkpoint number of the state in memory at the last boundary or load

    # ---- the engine and the session ----------------------------------------------------------------------------

    @property
    def session(self) -> TrainingSession:
        """The training session, made at its first use on every rank together (after an ended one, a new one on
        the same engine: saves after training continue the run)."""
        if self._session is None or self._session.ended:
            session = TrainingSession(self._engine(), self._session_state, is_main=self.strategy.is_global_zero)
            session.use_peer_loss(PeerLossConfig(enabled=self.io.survivor_saves))
            session.add_sink(self._log)
            self._session = session
        return self._session

    def _engine(self) -> CheckpointManager:
        if self._manager is None or self._manager.closed:
            config = self._settled()
            if config.persist == "thread":
                stop_early_server()
            self._manager = CheckpointManager(config, protected_steps=self._pending_names)
            self._names = repaired_writer(self._manager)
            # after the engine's own exit hook, so it runs first: the last names are written before the engine goes
            threading._register_atexit(functools.partial(_end_at_exit, weakref.ref(self)))  # type: ignore[attr-defined]
        return self._manager

    def _settled(self) -> CheckpointConfig:
        """The plugin's settings, with ``"auto"`` settled by the modules of the state seen first (unknown: the
        staging barrier that suits any model, and the helper process chosen by the tensor bytes)."""
        state = dict(self._sized_by or {})
        modules = [m for m in _unwrap_objects(list(state.values())) if isinstance(m, Module)]
        config = self.io.config
        if modules:
            config = barrier_for(config, modules)
        elif config.staging_barrier == "auto":
            config = dataclasses.replace(config, staging_barrier="forward")
        if self.io.persist == "auto":
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            persist = auto_persist(modules, world) if modules else auto_persist_for_bytes(tensor_bytes(state), world)
            config = dataclasses.replace(config, persist=persist)
        return config

    def _pending_names(self) -> set[int]:
        return self._names.pending_steps() if self._names is not None else set()

    def observe(self, state: Mapping[str, Any]) -> None:
        """A state the user handed over: the first optimizer in it has its steps counted, and the first one with a
        module settles the engine's ``"auto"`` settings."""
        objects = _unwrap_objects(list(state.values()))
        optimizer = next((o for o in objects if isinstance(o, Optimizer)), None)
        if optimizer is not None and not self._counting:
            self._counting = True
            hook = optimizer.register_step_post_hook(functools.partial(_count, weakref.ref(self)))
            weakref.finalize(self, hook.remove)
        if self._sized_by is None and any(isinstance(o, Module) for o in objects):
            self._sized_by = state

    # ---- save ------------------------------------------------------------------------------------------------

    def save(
        self, path: _PATH, state: dict[str, Any], filter: Any | None = None, storage_options: Any | None = None
    ) -> None:
        """``fabric.save`` under the pack's strategy, on every rank: ``state`` holds the objects themselves, so
        the modules' and optimizers' state dicts, alike on every DDP rank, are written a share per rank."""
        self.observe(state)
        checkpoint = self.strategy._convert_stateful_objects_in_state(state, filter=filter or {})
        self.save_dict(checkpoint, path, storage_options, replicated=_replicated(state, checkpoint))

    def save_dict(
        self,
        checkpoint: dict[str, Any],
        path: _PATH,
        storage_options: Any | None = None,
        *,
        replicated: tuple[str, ...] | None = None,
    ) -> None:
        """Save the state dicts of one ``fabric.save`` as a new step named ``path``; without an optimizer in them,
        write ``path`` as Fabric does. ``replicated``: the keys alike on every rank (None: all)."""
        if not any(_is_optimizer_state(value) for value in checkpoint.values()):
            if self.strategy.is_global_zero:  # weights only: no step a resume could take for the training state
                if self._names is not None:
                    self._names.forget(os.fspath(path))
                TorchCheckpointIO().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        session = self.session
        number = self.numbers.for_save()
        with session.blocking():
            handle = session.save(number, self._save_state(checkpoint, replicated), reason="named")
            if handle is not None:
                self.numbers.saved(number)
            now = tensor_bytes(checkpoint) < self.io.sync_names_below_mb * 2**20  # small: the file when it returns
            run_id = session.manager.run_id
            publish(self._names, os.fspath(path), number, checkpoint, handle, run_id, FILE, storage_options, now=now)

    def _save_state(self, checkpoint: dict[str, Any], replicated: tuple[str, ...] | None) -> SaveState:
        """The engine's view of a Fabric checkpoint: the dict, shared, and each rank's RNG. A value only pickle
        stores is refused now, on every rank alike, rather than at the load (which would refuse it)."""
        if not self.io.config.allow_pickle:
            self.session.manager.groups.control.agree(lambda: _refuse_pickles(checkpoint))
        extra = {"adapter": "fabric", "optimizer_steps": self.numbers.optimizer_steps}
        return SaveState(checkpoint, {"rng": capture_rng()}, extra, replicated=replicated)

    def _session_state(self, step: int) -> SaveState:
        """What the session saves by itself (emergency, interval and survivor saves): ``resume``'s dict now."""
        if self.training_state is None:
            raise ConfigError(_NO_TRAINING_STATE)
        state = _unwrap_objects(self.training_state)
        checkpoint = self.strategy._convert_stateful_objects_in_state(state, filter={})
        return self._save_state(checkpoint, _replicated(state, checkpoint))

    # ---- load ------------------------------------------------------------------------------------------------

    def load(self, path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """The dict at ``path`` for ``Strategy.load_checkpoint``, on every rank: a step of the engine (verified,
        this rank's RNG put back), or any other file as Fabric reads it."""
        held, self._held = self._held, None
        restored = held if held is not None and os.fspath(path) == held.path else None
        if restored is None:
            try:  # a name holds the whole dict its step was saved from: weights-only dicts make no step
                step, plain = resolve(os.fspath(path), self._names, self.io.config, partial=lambda keys: False)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"Checkpoint {path} does not exist: pass a file fabric.save wrote (or any torch.save file), or "
                    "call resume(fabric, state) for the newest committed checkpoint"
                ) from None
            if plain is not None:
                return TorchCheckpointIO().load_checkpoint(plain, weights_only=weights_only)
            restored = self.session.restore(step=step, per_rank=PER_RANK)
            if restored is None:
                raise NoCheckpointError(f"No committed checkpoint verifies for {path}: run `resilience ls`")
        self._in_place(restored)
        return dict(restored.state)

    def newest(self, state: dict[str, Any]) -> Restored | None:
        """``resume``: ``state`` is the training state from now on; the newest checkpoint that verifies is read,
        for the ``fabric.load`` that puts it in place (None: nothing committed, nothing changes)."""
        self.training_state = state
        self.observe(state)
        restored = self.session.restore(step=None, per_rank=PER_RANK)
        if restored is None:
            self.session.restored(None)
        self._held = restored
        return restored

    def _in_place(self, restored: Restored) -> None:
        steps = int(restored.manifest.extra.get("optimizer_steps", restored.step))
        self.numbers.restored(restored.step, steps)
        self._boundary_steps, self._last_number = steps, restored.step
        if self.session.started:  # loaded mid-run: newer checkpoints are set aside at the next save, as on a restart
            self.session.manager.claim(resumed_from=restored.step)
        self.session.restored(restored, rng_at="now", position=f"optimizer step {steps}")

    # ---- the step boundary (the pack's callbacks) ---------------------------------------------------------------

    def batch_start(self) -> None:
        """``on_train_batch_start``: training runs (the session starts), and a step begins with its batch in hand."""
        session = self.session
        session.start(self.numbers.current)
        session.step_begin(self.numbers.current)

    def batch_end(self) -> None:
        """``on_train_batch_end``: after an optimizer step (not mid-accumulation), the step boundary, collective.
        An agreed stop (its step saved) ends the process with the stop's code."""
        steps = self.numbers.optimizer_steps
        if steps == self._boundary_steps:
            return
        if self.training_state is None:
            raise ConfigError(_NO_TRAINING_STATE)
        session = self.session
        session.start(self._last_number)
        self._boundary_steps, number = steps, self.numbers.current
        boundary = session.step_end(number)
        self._last_number = number
        if boundary.saved is not None and boundary.saved.step == number:
            self.numbers.saved(number)
        if boundary.stop is not None:
            session.exit()

    # ---- end ---------------------------------------------------------------------------------------------------

    def end(self, *, close: bool = False) -> None:
        """The last names written and the session ended (its last saves waited for, the ledger closed); with
        ``close`` the engine too, else it rests for saves after training. Raises the first save's failure."""
        try:
            if self._names is not None:
                self._names.wait()
        finally:
            if self._session is not None and not self._session.ended:
                self._session.end(close_manager=close)
            elif close and self._manager is not None and not self._manager.closed:
                self._manager.close()

    def _at_exit(self) -> None:
        try:
            self.end(close=True)
        except Exception:
            log.exception("the last checkpoint saves failed")

    def _log(self, metrics: dict[str, float]) -> None:
        fabric = self.fabric
        if fabric is not None and fabric.is_global_zero and fabric.loggers:
            fabric.log_dict(metrics, step=self.numbers.current)


_NO_TRAINING_STATE = (
    "The pack has no training state to save at a step boundary: call resume(fabric, state) before the training "
    "loop, with the dict you pass to fabric.save"
)


def serve(strategy: Strategy, io: ResilientCheckpointIO) -> FabricCheckpoints:
    """The checkpoints of ``strategy``, made once; the pack's strategy calls it on every rank."""
    found: FabricCheckpoints | None = getattr(strategy, _ATTRIBUTE, None)
    if found is None or found.io is not io:
        found = FabricCheckpoints(strategy, io)
        setattr(strategy, _ATTRIBUTE, found)
        _LIVE.add(found)
    return found


def called_by(io: ResilientCheckpointIO, caller: Any) -> FabricCheckpoints | None:
    """For a call of ``io`` from a Fabric strategy: its checkpoints, if the pack serves it (its own strategy, or
    Fabric's on one process). Fabric's own strategies call a CheckpointIO on rank 0 only under several processes:
    None there, and ``io`` saves as for Lightning's (a plain file, with a warning)."""
    if not isinstance(caller, Strategy) or caller.checkpoint_io is not io:
        return None
    if hasattr(caller, _ATTRIBUTE) or not is_distributed():
        return serve(caller, io)
    return None


def end_all(io: ResilientCheckpointIO) -> None:
    """The plugin's teardown (Fabric's ``Strategy.teardown`` calls it): the checkpoints it serves end their
    session and close their engines (a later save starts another)."""
    for checkpoints in [found for found in _LIVE if found.io is io]:
        checkpoints.end(close=True)


def _count(ref: weakref.ref[FabricCheckpoints], *_: Any) -> None:
    """The counted optimizer stepped (its hook holds no reference to the checkpoints)."""
    checkpoints = ref()
    if checkpoints is not None:
        checkpoints.numbers.optimizer_steps += 1


def _end_at_exit(ref: weakref.ref[FabricCheckpoints]) -> None:
    checkpoints = ref()
    if checkpoints is not None:
        checkpoints._at_exit()


def _replicated(state: Mapping[str, Any], checkpoint: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of modules and optimizers: their state dicts are alike on every DDP rank."""
    return tuple(k for k, v in state.items() if k in checkpoint and isinstance(v, (Module, Optimizer)))


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def _refuse_pickles(checkpoint: dict[str, Any]) -> None:
    pickled = flatten(checkpoint).pickled
    if pickled:
        raise ConfigError(
            f"fabric.save: the value at {pickled[0]!r} is an object only pickle can store, and a pickle runs code when "
            "it is loaded. Save plain values there (numbers, strings, lists, dicts, tensors, dates and times), or set "
            "ResilientCheckpointIO(allow_pickle=True) if only you can write to the checkpoint storage"
        )
