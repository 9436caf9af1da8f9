"""``ResilientDDPStrategy``: DDP where every rank takes part in a save, so each writes its own part.

Lightning's base strategy calls the CheckpointIO on rank 0 only. That is right for ``torch.save`` of a full
state, but a sharded, deduplicated save is collective: every rank must join. Overriding
``Strategy.save_checkpoint`` in a strategy subclass is the pattern Lightning itself uses for sharded
strategies (``ModelParallelStrategy``); it is selected by name (``strategy="resilient_ddp"``), by class, or by
``class_path`` in a LightningCLI config, and needs no change to the user's module or callbacks.
``EveryRankSaves`` is that override, shared with ``ResilientModelParallelStrategy`` (model_parallel_strategy.py);
``PackPlugin``, its plugin, is shared with Fabric's strategy (``fabric/strategy.py``).
It also tells the plugin its Trainer (``ResilientCheckpointIO.bind``), which Lightning never tells a CheckpointIO:
in ``connect``, the first thing of every run (fit, validate, test, predict), before any load, and in each save.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from resilience.formats.names import FILE
from resilience.persist.fork_server import share_server


class PackPlugin:
    """What every strategy of the pack (Lightning's and Fabric's) adds first: its CheckpointIO is a
    ``ResilientCheckpointIO``, one with the defaults unless given."""

    _checkpoint_io: Any

    @property
    def checkpoint_io(self) -> ResilientCheckpointIO:
        io = self._checkpoint_io
        if io is None:
            io = self._checkpoint_io = ResilientCheckpointIO()
        if not isinstance(io, ResilientCheckpointIO):
            raise TypeError(
                f"{type(self).__name__} needs a ResilientCheckpointIO, got {type(io).__name__}: remove the other "
                "CheckpointIO plugin, or use Lightning's own strategy with it"
            )
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io


class EveryRankSaves(PackPlugin):
    """What a resilient strategy adds to Lightning's: every rank takes part in each save, through the plugin.

    Mixed in before a Lightning strategy class; ``name_layout`` says what the names become (``names.FILE`` or
    ``names.SHARDED``).
    """

    name_layout = FILE
    strategy_name: str
    description: str  # what Lightning's strategy registry lists
    lightning_module: pl.LightningModule | None
    cluster_environment: Any
    num_processes: int

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.description)

    def _configure_launcher(self) -> None:
        """Lightning's launcher; the ranks it starts from this process fork their helper processes from this
        one's fork server, which is up by their first save; theirs would not be."""
        super()._configure_launcher()  # type: ignore[misc]
        environment = self.cluster_environment
        starts_ranks = environment is not None and not environment.creates_processes_externally
        if starts_ranks and self.num_processes > 1 and self.checkpoint_io.config.persist == "process":
            share_server()

    def connect(self, model: pl.LightningModule) -> None:
        """Lightning's connect (the model's Trainer is attached by now), then the plugin learns that Trainer."""
        super().connect(model)  # type: ignore[misc]
        self.checkpoint_io.bind(model.trainer)

    def __getstate__(self) -> dict[str, Any]:
        """A Trainer is picklable (``torch.save(trainer)``, as after a ``ddp_spawn`` fit): the launcher goes
        without the processes it started, whose handles hold locks and mean nothing to a copy."""
        state: dict[str, Any] = super().__getstate__()  # type: ignore[misc]
        launcher = state.get("_launcher")
        if getattr(launcher, "procs", None):
            state["_launcher"] = launcher = copy.copy(launcher)
            launcher.procs = []
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # every rank writes its shards; rank 0's name for the checkpoint is the one all ranks use
        filepath = self.broadcast(filepath)  # type: ignore[attr-defined]
        io = self.checkpoint_io
        assert self.lightning_module is not None  # Trainer.save_checkpoint refuses a Trainer without a model
        io.bind(self.lightning_module.trainer)  # also after fit(), whose teardown unbound the plugin
        io.save_checkpoint(checkpoint, filepath, storage_options=storage_options, layout=self.name_layout)


class ResilientDDPStrategy(EveryRankSaves, DDPStrategy):
    """DDP with collective, asynchronous checkpoint saves through :class:`ResilientCheckpointIO`.

    Takes every argument of ``DDPStrategy``. Without a ``checkpoint_io`` (here or as a Trainer plugin) it uses
    ``ResilientCheckpointIO()`` with its defaults.
    """

    strategy_name = "resilient_ddp"
    description = "DDP whose checkpoint saves are async and written by every rank"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError(
                "ResilientDDPStrategy needs start_method='popen' (processes launched by Lightning, torchrun or "
                "SLURM): spawn-based launchers save on rank 0 only to hand weights back to the parent process"
            )
        super().__init__(*args, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        super().register_strategies(strategy_registry)
        strategy_registry.register(
            "resilient_ddp_find_unused_parameters_true",
            cls,
            description="resilient_ddp with find_unused_parameters=True",
            find_unused_parameters=True,
        )


ResilientDDPStrategy.register_strategies(StrategyRegistry)
