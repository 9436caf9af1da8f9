"""LightningCLI entry point for the demo model: every feature of the pack comes from the YAML config.

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml

Run the same command again after a crash, a preemption or an injected fault: it resumes from the newest
committed checkpoint. Try ``RESILIENCE_INJECT="xid=79@step=30,rank=1"`` for a fault drill.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_resilience  # noqa: F401  (registers strategy="resilient_ddp")
from examples.demo_model import DemoData, DemoModel


def main() -> None:
    LightningCLI(DemoModel, DemoData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
