"""What a Fabric training loop calls: :func:`resume` before the loop, and the callbacks that answer its hooks.

Fabric calls one hook of its callbacks by itself that matters here: ``on_after_setup``, in ``fabric.setup``, which
tells the callbacks their Fabric. The step boundary, where the ranks agree on faults and stop signals and the ledger
counts a step, must come after everything a step changes (the optimizer, a scheduler, the counters in the training
state), which only the loop knows: the loop calls ``fabric.call("on_train_batch_end")`` there. Optional:
``fabric.call("on_train_batch_start")`` once the batch is in hand (data-wait figures), and
``fabric.call("on_train_end")`` after the loop (the last saves are waited for and the ledger ends as completed;
the process's exit does both otherwise).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from lightning.fabric import Fabric
from lightning.fabric.strategies import Strategy

from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from lightning_resilience.fabric.checkpoints import FabricCheckpoints, called_by
from resilience.errors import ConfigError
from resilience.goodput import GoodputConfig
from resilience.health import HealthConfig, SignalWatcher, signal_watcher
from resilience.session import TrainingSession


def checkpoints_of(strategy: Strategy) -> FabricCheckpoints:
    """The pack's checkpoints of a Fabric strategy; a clear error where the pack cannot serve it."""
    io = strategy.checkpoint_io
    if not isinstance(io, ResilientCheckpointIO):
        raise ConfigError(
            f"This Fabric saves through {type(io).__name__}, not the pack: create it with "
            "Fabric(plugins=[ResilientCheckpointIO(...)]) (and strategy='resilient_ddp' for several processes)"
        )
    found = called_by(io, strategy)
    if found is None:
        raise ConfigError(
            f"Fabric's {type(strategy).__name__} saves on rank 0 only, and the pack's saves need every rank: create "
            "Fabric with strategy='resilient_ddp'"
        )
    return found


def resume(fabric: Fabric, state: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """Load the newest committed checkpoint that verifies into ``state``, in place, as ``fabric.load`` does.

    Call it on every rank, before the training loop, with the dict the loop passes to ``fabric.save``. Modules,
    optimizers and other stateful objects are loaded in place and plain values replaced; each rank's RNG comes back
    too, and checkpoint numbers go on from the loaded one. With nothing committed yet, ``state`` is left as it is.
    From then on ``state`` is what the pack saves by itself (a preemption's or GPU fault's emergency save).

    Returns:
        What the checkpoint holds beyond ``state``'s keys (``fabric.load``'s remainder); ``{}`` with nothing to load.
    """
    restored = checkpoints_of(fabric.strategy).newest(state)
    if restored is None:
        return {}
    return fabric.load(restored.path, state, strict=strict)


class SessionCallback:
    """The hooks a Fabric loop calls (``fabric.call``), answered by the pack's checkpoints of its strategy; each
    callback adds its part to their training session. Several of them drive the boundary once per optimizer step."""

    _checkpoints: FabricCheckpoints | None = None
    _session: TrainingSession | None = None

    def configure(self, session: TrainingSession, checkpoints: FabricCheckpoints) -> None:
        """Add this callback's part to the session (before training starts); collective where it must be."""

    def on_after_setup(self, fabric: Fabric, module: Any) -> None:
        """Called by ``fabric.setup`` on every rank: the session is made (collective) and this callback's part added."""
        checkpoints = checkpoints_of(fabric.strategy)
        checkpoints.fabric = fabric
        checkpoints.observe({"module": module})
        session = checkpoints.session
        if session is not self._session:
            self._checkpoints, self._session = checkpoints, session
            self.configure(session, checkpoints)

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        """Optional, once the batch is in hand: the wait for it is data wait."""
        self._bound().batch_start()

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """After the step's optimizer step and whatever else it changes: the step boundary (collective). After an
        agreed stop the step is saved and the process exits with the stop's code."""
        self._bound().batch_end()

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        """After the loop: the last saves and names are waited for and the ledger ends as completed."""
        self._bound().end()

    def _bound(self) -> FabricCheckpoints:
        if self._checkpoints is None:
            raise ConfigError(
                f"{type(self).__name__} has not met its Fabric: pass it in Fabric(callbacks=[...]) and set up the "
                "model with fabric.setup(...) before the training loop"
            )
        return self._checkpoints


class HealthGuardCallback(SessionCallback):
    """On a GPU fault or a preemption signal, every rank saves the same step and the process exits 69 or 75.

    Takes the keyword arguments of the Lightning ``HealthGuardCallback`` (the fields of
    :class:`~resilience.health.HealthConfig`; docs/HEALTH.md). The ranks agree at ``on_train_batch_end``; the step
    saved is ``resume``'s state. From its construction until training begins, a stop signal ends the process at
    once with the preemption code: nothing is trained yet.
    """

    def __init__(self, **settings: Any) -> None:
        self.config = HealthConfig(**settings)
        self._signals: SignalWatcher | None = None
        if threading.current_thread() is threading.main_thread():
            self._signals = signal_watcher(self.config)  # the session's guard gives it its event log
            self._signals.install()

    def configure(self, session: TrainingSession, checkpoints: FabricCheckpoints) -> None:
        session.use_health(self.config, signals=self._signals)  # collective: the agreement's gloo group


class GoodputMonitor(SessionCallback):
    """Keeps the run's goodput ledger across restarts (``resilience report``) and logs the pack's metrics to
    Fabric's loggers.

    Takes the keyword arguments of the Lightning ``GoodputMonitor`` (the fields of
    :class:`~resilience.goodput.GoodputConfig`); ``run_dir`` defaults to the plugin's ``local_root``.
    """

    def __init__(self, **settings: Any) -> None:
        self.config = GoodputConfig(**{"run_dir": "", **settings})

    def configure(self, session: TrainingSession, checkpoints: FabricCheckpoints) -> None:
        run_dir = self.config.run_dir or str(checkpoints.io.config.local_root)
        session.use_goodput(dataclasses.replace(self.config, run_dir=run_dir))
