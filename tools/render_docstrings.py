"""Write each adapter's ``Args:`` section into its source, rendered from the engine configs' field texts.

Run it after changing a config's documentation or an adapter's arguments; ``tests/test_docstrings.py`` fails
until the written sections match (:mod:`resilience.docstrings`).

    .venv/bin/python tools/render_docstrings.py
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accelerate_resilience import ResiliencePlugin
from lightning_resilience import (
    GoodputMonitor,
    HealthGuardCallback,
    PeriodicCheckpoint,
    ResilientCheckpointIO,
)
from resilience.docstrings import write_section

# every adapter class whose section comes from the engine configs (resilience.docstrings.documented_by)
ADAPTERS: list[type] = [
    ResilientCheckpointIO,
    HealthGuardCallback,
    PeriodicCheckpoint,
    GoodputMonitor,
    ResiliencePlugin,
]


def main() -> None:
    for cls in ADAPTERS:
        if write_section(cls):
            print(f"rewrote {cls.__qualname__}'s Args section in {inspect.getsourcefile(cls)}")


if __name__ == "__main__":
    main()
