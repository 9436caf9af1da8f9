"""``ResilientModelParallelStrategy``: Lightning's ModelParallelStrategy (FSDP2, tensor parallel, HSDP) with its
checkpoints saved asynchronously through the engine, committed by manifest, and resumed by ``AutoResume``.

Lightning's ``ModelParallelStrategy`` saves a sharded checkpoint itself, with a synchronous
``torch.distributed.checkpoint.save`` on every rank, and never calls a CheckpointIO. This subclass overrides the
same two methods Lightning overrides for it (``save_checkpoint``, ``load_checkpoint``), so every rank hands its
DTensor shards to the engine: staged into reused host buffers, written in the background, committed, uploaded.
The state dicts it takes are the live ones (Lightning's copy them to CPU first, ``cpu_offload=True``: a
blocking device-to-host copy into fresh memory on every save); the engine's staging is the one copy. Loads
reshard: a checkpoint saved on one layout (dp=2) resumes on another (dp=1, tp=2). Names are Lightning's own
sharded checkpoint directories (:mod:`resilience.formats.lightning_sharded`), which a stock
``ModelParallelStrategy`` and ``consolidate_checkpoint`` read.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from lightning_resilience.strategy import EveryRankSaves
from resilience.formats.names import SHARDED


class ResilientModelParallelStrategy(EveryRankSaves, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sharded checkpoints go through :class:`ResilientCheckpointIO`.

    Takes the arguments of ``ModelParallelStrategy`` (apply ``fully_shard`` / ``parallelize_module`` in
    ``configure_model`` as with it) and a ``checkpoint_io``; without one (here or as a Trainer plugin) it uses
    ``ResilientCheckpointIO()`` with its defaults. ``save_distributed_checkpoint=False`` (a full state gathered
    on rank 0) is Lightning's own strategy's job: use ``ModelParallelStrategy`` for that.
    """

    strategy_name = "resilient_model_parallel"
    description = "ModelParallelStrategy (FSDP2, tensor parallel) whose sharded saves are async and committed"
    name_layout = SHARDED

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_io: ResilientCheckpointIO | None = None,
    ) -> None:
        if not save_distributed_checkpoint:
            raise ValueError(
                "ResilientModelParallelStrategy saves sharded checkpoints; for a full state gathered on rank 0 "
                "(save_distributed_checkpoint=False) use Lightning's ModelParallelStrategy"
            )
        super().__init__(data_parallel_size, tensor_parallel_size, True, process_group_backend, timeout)
        self._checkpoint_io = checkpoint_io

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict, its DTensors the live parameters (no copy: staging makes the one)."""
        assert self.model is not None
        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's sharded state, keyed by parameter name (resharding needs names, not indices)."""
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Engine checkpoints (``AutoResume``, ``"last"``, a name of this run) load into the live shards, resharded
        to this run's layout; anything else (Lightning's own sharded directory or full file, a name whose step
        retention deleted) loads as Lightning's ``ModelParallelStrategy`` loads it."""
        path = os.fspath(self.broadcast(checkpoint_path))
        io = self.checkpoint_io
        # rank 0 resolves (it writes the names); its answer, or its error, reaches every rank
        step, plain = io.manager.groups.control.decide(lambda: io.resolve(path))
        if plain is not None:
            return super().load_checkpoint(plain, weights_only=weights_only)
        assert self.model is not None and self.lightning_module is not None
        model, optimizers = self.model, self.optimizers
        checkpoint = io.load_engine(
            step,
            target=lambda: {
                "state_dict": get_model_state_dict(model),
                "optimizer_states": [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers],
            },
            leave_out=() if optimizers else ("optimizer_states",),
        )
        strict = StateDictOptions(strict=self.lightning_module.strict_loading)
        set_model_state_dict(model, checkpoint.pop("state_dict"), options=strict)
        for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", []), strict=True):
            set_optimizer_state_dict(model, optimizer, state)
        return checkpoint


ResilientModelParallelStrategy.register_strategies(StrategyRegistry)
