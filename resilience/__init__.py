"""Framework-free engine: async sharded checkpoints, commit protocol, tiers, discovery and resume.

Imports neither Lightning nor Accelerate; the adapter packages build on it.
"""

__version__ = "0.1.0"

from resilience.config import CheckpointConfig
from resilience.errors import (
    CheckpointError,
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    ResilienceError,
)
from resilience.loader import Restored
from resilience.manager import CheckpointManager, SaveStats
from resilience.pipeline import SaveHandle

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "ConfigError",
    "CorruptCheckpointError",
    "NoCheckpointError",
    "ResilienceError",
    "Restored",
    "SaveHandle",
    "SaveStats",
    "__version__",
]
