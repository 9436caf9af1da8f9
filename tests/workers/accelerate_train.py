"""A small, fully seeded Accelerate training job: launched by tests/test_accelerate_launch.py through
``accelerate launch``, and built in-process (``build_job``/``train``) by tests/test_accelerate_handle.py.

Usage: accelerate_train.py OUT_DIR. Writes OUT_DIR/final-rank<R>.pt (model, optimizer, scheduler, the sample
indices trained on, the resume point) and OUT_DIR/metrics.jsonl (what reached the tracker). Checkpoint settings
come from ``ACCELERATE_RESILIENCE_*``; the test knobs: TRAIN_STOP_AT (save with ``accelerator.save_state()`` at
this global step and stop), TRAIN_STATEFUL (1: a StatefulDataLoader, 0: a plain DataLoader resumed by skipping),
TRAIN_STEP_SLEEP (seconds per step, so a test can kill the job mid-run), TRAIN_EPOCHS (3 by default),
TRAIN_PREEMPT_AT (the first elastic attempt's rank 1 gets a SIGTERM at this step, through the health package's
fault injection), TRAIN_TIMED (1: the
loop draws batches through ``resilience.timed``), TRAIN_VICTIM=RANK:STEP (that rank SIGKILLs itself as the step
after STEP begins, in the first generation only under ``resilience launch``; the other's survivor save follows
from the failed all-reduce), TRAIN_FSDP2 (1: Accelerate's FSDP2, ``fsdp_version=2``; the final states are then
gathered to full tensors, and OUT_DIR/restored-rank<R>.pt holds the state just resumed). Each rank also records
the ``every_n_steps="auto"`` plans it followed, and the step at which it got each.

Accelerate 1.15 turns FSDP on only for GPU-class distributed types (``AcceleratorState`` leaves ``MULTI_CPU``, what
``Accelerator(cpu=True)`` under ``accelerate launch --multi_gpu`` is, without it, and wraps the model in DDP), so on
CPU the FSDP2 mode sets the states' distributed type to FSDP after the Accelerator is made: from there on
``prepare()`` runs Accelerate's own FSDP2 path (``fsdp2_prepare_model``: ``fully_shard`` on a gloo mesh).

Dropout (torch RNG), Python and NumPy random numbers enter the loss, so any RNG stream restored wrongly shows in
the final parameters; each rank records the sample indices it trained on in an object registered for
checkpointing, so the data order, and per-rank object state, can be compared exactly too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin, PartialState
from accelerate.tracking import GeneralTracker
from accelerate.utils import DistributedType, set_seed
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.utils.data import DataLoader, TensorDataset

from accelerate_resilience import ResilienceHandle, ResumePoint, attach, compat
from tests.workers.slow_load import slow_down_loads_from_env
from tests.workers.victim import die_after_boundary

EPOCHS = int(os.environ.get("TRAIN_EPOCHS", "3"))
SAMPLES = 40
BATCH = 4


class JsonlTracker(GeneralTracker):
    """A third-party tracker: what accelerator.log sends, one JSON line per call."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    @property
    def tracker(self) -> Path:
        return self.path

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        with self.path.open("a") as stream:
            stream.write(json.dumps({"step": step, **values}) + "\n")


class SeenSamples:
    """Per-rank state registered for checkpointing: the sample indices this rank trained on, in order."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"indices": list(self.indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.indices = list(state["indices"])


@dataclasses.dataclass
class Job:
    accelerator: Accelerator
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    scheduler: torch.optim.lr_scheduler.LRScheduler
    seen: SeenSamples
    plans: list[tuple[int, dict[str, Any]]] = dataclasses.field(default_factory=list)


def build_job(accelerator: Accelerator) -> Job:
    """The same seeded model, data and optimizer every time, prepared and registered on ``accelerator``."""
    set_seed(1234)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 1))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    seen = SeenSamples()
    accelerator.register_for_checkpointing(seen)
    return Job(accelerator, model, optimizer, loader, scheduler, seen)


def train(
    job: Job,
    resilience: ResilienceHandle,
    point: ResumePoint,
    *,
    stop_at: int = 0,
    sleep_s: float = 0.0,
    timed: bool = False,
) -> None:
    """Train from ``point`` to the end of the last epoch, or save with ``accelerator.save_state()`` at ``stop_at``.

    ``timed``: wrap the loader in ``resilience.timed`` once, before the epochs, so that skipping into the
    resumed epoch goes through the wrapper too.
    """
    accelerator = job.accelerator
    loader = resilience.timed(job.loader) if timed else job.loader
    victim, victim_step = (int(v) for v in os.environ.get("TRAIN_VICTIM", "-1:-1").split(":"))
    if os.environ.get("RESILIENCE_GENERATION", "0") != "0":
        victim = -1  # a rank replaced in place (resilience launch) does not die again
    for epoch in range(point.epoch, EPOCHS):
        batches = accelerator.skip_first_batches(loader, point.batches_to_skip) if epoch == point.epoch else loader
        for indices, x, y in batches:
            if resilience.should_stop():  # all ranks agreed on a stop; this step is saved already
                return
            if resilience.global_step == victim_step and accelerator.process_index == victim:
                die_after_boundary(resilience.session, victim_step)
            scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
            loss = F.mse_loss(job.model(x), y) * scale
            accelerator.backward(loss)
            job.optimizer.step()
            job.scheduler.step()
            job.optimizer.zero_grad()
            job.seen.indices.extend(indices.tolist())
            plan = resilience.interval_plan
            if plan is not None and (not job.plans or job.plans[-1][1] != plan.to_dict()):
                job.plans.append((resilience.global_step, plan.to_dict()))
            if sleep_s:
                time.sleep(sleep_s)
            if resilience.global_step == stop_at:
                accelerator.save_state()  # routed to resilience.save(): the habit keeps working
                return


def final_state(job: Job) -> dict[str, Any]:
    """What the tests compare; under FSDP2 the model and optimizer gathered to full tensors (collective)."""
    if compat.is_fsdp2(job.accelerator):
        full = StateDictOptions(full_state_dict=True)  # on every rank (cpu_offload would keep it to rank 0)
        model = get_model_state_dict(job.model, options=full)
        optimizer = get_optimizer_state_dict(job.model, job.optimizer.optimizer, options=full)  # type: ignore[attr-defined]
    else:
        model, optimizer = job.accelerator.unwrap_model(job.model).state_dict(), job.optimizer.state_dict()
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": job.scheduler.state_dict(),
        "indices": list(job.seen.indices),
        "plans": list(job.plans),
    }


def main() -> None:
    out = Path(sys.argv[1])
    fsdp2 = os.environ.get("TRAIN_FSDP2") == "1"
    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp2 else None
    accelerator = Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=os.environ.get("TRAIN_STATEFUL", "1") == "1", use_seedable_sampler=True
        ),
        log_with=[JsonlTracker(out / "metrics.jsonl")],
        fsdp_plugin=fsdp_plugin,
    )
    if fsdp2:  # see the module's docstring: Accelerate keeps FSDP off on CPU
        # both singletons, as AcceleratorState sets them itself on GPUs (each AcceleratorState() made later, by
        # prepare() for one, copies PartialState's type over its own)
        PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = fsdp_plugin
    accelerator.init_trackers("accelerate-resilience-test")
    job = build_job(accelerator)
    preempt_at = os.environ.get("TRAIN_PREEMPT_AT")
    if preempt_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.environ["RESILIENCE_INJECT"] = f"signal=SIGTERM@step={preempt_at},rank=1"
    slow_down_loads_from_env()
    resilience = attach(accelerator)
    point = accelerator.load_state()  # routed to resilience.resume()
    rank = accelerator.process_index
    print(f"RESUME rank={rank} {json.dumps(dataclasses.asdict(point))}", flush=True)
    if fsdp2:
        torch.save(final_state(job), out / f"restored-rank{rank}.pt")
    train(
        job,
        resilience,
        point,
        stop_at=int(os.environ.get("TRAIN_STOP_AT", "0")),
        sleep_s=float(os.environ.get("TRAIN_STEP_SLEEP", "0")),
        timed=os.environ.get("TRAIN_TIMED") == "1",
    )
    torch.save({**final_state(job), "resume": dataclasses.asdict(point)}, out / f"final-rank{rank}.pt")
    accelerator.end_training()  # routed: closes the handle (waits for the last save) first
    print(f"DONE rank={rank} step={resilience.global_step}", flush=True)


if __name__ == "__main__":
    main()
