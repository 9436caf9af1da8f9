"""The plain-Trainer way: the pack added to a Trainer you already have.

python examples/lightning_trainer.py                 # 2 CPU ranks; kill it any time, run it again
RESILIENCE_INJECT="signal=SIGTERM@step=30" python examples/lightning_trainer.py   # a preemption drill
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.demo_model import DemoData, DemoModel
from lightning_resilience import (
    AutoResume,
    GoodputMonitor,
    HealthGuardCallback,
    PeriodicCheckpoint,
    ResilientCheckpointIO,
    ResilientDDPStrategy,
)

RUN = os.path.join("runs", "lightning-trainer")


def main() -> None:
    pl.seed_everything(7)
    checkpoints = ResilientCheckpointIO(
        local_root=os.path.join(RUN, "checkpoints"),
        durable_url=f"file://{os.path.abspath(os.path.join(RUN, 'durable'))}",  # or s3://bucket/run
        async_staging=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ResilientDDPStrategy(),
        plugins=[checkpoints],
        max_steps=60,
        use_distributed_sampler=False,  # DemoData brings a StatefulDistributedSampler
        default_root_dir=RUN,
        enable_progress_bar=False,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(RUN, "named"), every_n_train_steps=20),
            AutoResume(checkpoints),
            HealthGuardCallback(),
            GoodputMonitor(window_steps=10),
            PeriodicCheckpoint(every_n_steps="auto", min_interval_s=1.0),
        ],
    )
    trainer.fit(DemoModel(), DemoData())


if __name__ == "__main__":
    main()
