"""Framework-free engine: async sharded checkpoints, commit protocol, tiers, discovery and resume.

Imports neither Lightning nor Accelerate; the adapter packages build on it. Names are imported on first
use, so that the ``resilience`` command does not pay for importing torch when it only lists or checks files.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointConfig": "resilience.config",
    "CheckpointError": "resilience.errors",
    "CheckpointExistsError": "resilience.errors",
    "ConfigError": "resilience.errors",
    "CorruptCheckpointError": "resilience.errors",
    "NoCheckpointError": "resilience.errors",
    "ResilienceError": "resilience.errors",
    "Restored": "resilience.checkpoint.loader",
    "CheckpointManager": "resilience.checkpoint.manager",
    "SaveStats": "resilience.checkpoint.manager",
    "SaveHandle": "resilience.persist.pipeline",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from resilience.checkpoint.loader import Restored as Restored
    from resilience.checkpoint.manager import CheckpointManager as CheckpointManager
    from resilience.checkpoint.manager import SaveStats as SaveStats
    from resilience.config import CheckpointConfig as CheckpointConfig
    from resilience.errors import CheckpointError as CheckpointError
    from resilience.errors import CheckpointExistsError as CheckpointExistsError
    from resilience.errors import ConfigError as ConfigError
    from resilience.errors import CorruptCheckpointError as CorruptCheckpointError
    from resilience.errors import NoCheckpointError as NoCheckpointError
    from resilience.errors import ResilienceError as ResilienceError
    from resilience.persist.pipeline import SaveHandle as SaveHandle


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'resilience' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
