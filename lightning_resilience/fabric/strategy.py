"""``ResilientDDPStrategy`` for Lightning Fabric: DDP where every rank takes part in ``fabric.save``.

Fabric's DDP strategy calls its CheckpointIO on rank 0 only, with the state dicts already made. A save through the
engine is collective (every rank writes its share) and needs to know which entries are alike on every rank (the
modules' and optimizers' state dicts). Overriding ``Strategy.save_checkpoint`` is how Fabric's own sharded
strategies take over saving; this one hands the call to the pack's checkpoints for the strategy
(``checkpoints.py``) on every rank. Loads need no override: Fabric's ``Strategy.load_checkpoint`` asks the
CheckpointIO for the dict on every rank, and the plugin answers through the same checkpoints.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.utilities.types import _PATH

from lightning_resilience.fabric.checkpoints import serve
from lightning_resilience.strategy import PackPlugin
from resilience.persist.fork_server import share_server


class ResilientDDPStrategy(PackPlugin, DDPStrategy):  # type: ignore[misc]
    """Fabric's DDP with collective, asynchronous saves through ``ResilientCheckpointIO``.

    Takes every argument of Fabric's ``DDPStrategy``; select it with ``Fabric(strategy="resilient_ddp")``. Without
    a ``checkpoint_io`` (here or in ``Fabric(plugins=...)``) it uses ``ResilientCheckpointIO()`` with its defaults.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError(
                "Fabric's ResilientDDPStrategy runs with start_method='popen' only: processes started by "
                "fabric.launch() running the script again, by torchrun or by SLURM"
            )
        super().__init__(*args, **kwargs)

    def _configure_launcher(self) -> None:
        """Fabric's launcher; when it starts the other ranks from this process (``fabric.launch()``), they fork their
        helper processes from this one's fork server, which is up by their first save; theirs would not be."""
        super()._configure_launcher()
        launcher = self._launcher
        if isinstance(launcher, _SubprocessScriptLauncher) and self.checkpoint_io.config.persist == "process":
            self._launcher = _SharingLauncher(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)

    def setup_environment(self) -> None:
        """The process group, then the pack's checkpoints of this strategy (local: the engine comes later)."""
        super().setup_environment()
        serve(self, self.checkpoint_io)

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        # every rank writes its share; rank 0's name for the checkpoint is the one all ranks use
        path = self.broadcast(path)
        serve(self, self.checkpoint_io).save(path, state, filter, storage_options)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "resilient_ddp", cls, description="DDP whose fabric.save is asynchronous and written by every rank"
        )
        strategy_registry.register(
            "resilient_ddp_find_unused_parameters_true",
            cls,
            description="resilient_ddp with find_unused_parameters=True",
            find_unused_parameters=True,
        )


class _SharingLauncher(_SubprocessScriptLauncher):
    """Fabric's launcher, sharing this process's fork server with the ranks it starts, as they are started: a
    Fabric made and never launched leaves the environment as it was."""

    def _call_children_scripts(self) -> None:
        if self.num_processes > 1:
            share_server()
        super()._call_children_scripts()


ResilientDDPStrategy.register_strategies(STRATEGY_REGISTRY)
