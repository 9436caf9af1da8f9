"""Lightning adapter: an async distributed CheckpointIO, DDP and model-parallel strategies whose ranks all write,
and callbacks.

Importing this package registers the ``"resilient_ddp"`` and ``"resilient_model_parallel"`` strategy names.
"""

from lightning_resilience.auto_resume import AutoResume
from lightning_resilience.checkpoint_io import ResilientCheckpointIO
from lightning_resilience.goodput import GoodputMonitor
from lightning_resilience.health import HealthGuardCallback
from lightning_resilience.interval import PeriodicCheckpoint
from lightning_resilience.model_parallel_strategy import ResilientModelParallelStrategy
from lightning_resilience.strategy import ResilientDDPStrategy

__all__ = [
    "AutoResume",
    "GoodputMonitor",
    "HealthGuardCallback",
    "PeriodicCheckpoint",
    "ResilientCheckpointIO",
    "ResilientDDPStrategy",
    "ResilientModelParallelStrategy",
]
