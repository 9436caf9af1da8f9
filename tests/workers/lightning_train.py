"""The demo model (examples/demo_model.py) trained by a plain Trainer, for the tests.

Launched as a script (Lightning starts the other DDP rank by re-running it). ``--kill-at K`` makes the run
SIGKILL itself after step K once the checkpoints saved so far are committed; relaunching resumes.
``TEST_SLOW_WRITE_S`` slows every background write (in the checkpoint helper process), so a signal can land
mid-save. ``TEST_SLOW_SURVIVOR_S`` slows each survivor save, and ``TEST_SLOW_LEAVE_S`` rank 0's way out after an
error or a stop, past the 5 s in which Lightning's launcher sees another rank's exit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import threading
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.demo_model import DemoData, DemoModel
from lightning_resilience import AutoResume, HealthGuardCallback, ResilientCheckpointIO
from lightning_resilience.checkpoint_io import live_checkpoint_ios
from tests.workers.slow_load import slow_down_loads_from_env
from tests.workers.victim import die_after_boundary


class KillAfter(pl.Callback):
    """SIGKILL this process after a step, once the checkpoints saved so far are committed."""

    def __init__(self, step: int, io: ResilientCheckpointIO) -> None:
        self.step, self.io = step, io

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            self.io.manager.wait()
            trainer.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


class Victim(pl.Callback):
    """Rank ``rank`` SIGKILLs (or SIGSTOPs) itself at the start of the step after ``step``, in the middle of a run:
    the other ranks meet it missing in that step's gradient all-reduce."""

    def __init__(self, rank: int, step: int, how: str) -> None:
        self.rank, self.step, self.signal = rank, step, signal.SIGKILL if how == "kill" else signal.SIGSTOP

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        first = os.environ.get("RESILIENCE_GENERATION", "0") == "0"  # a replacement in place does not die again
        if trainer.global_step == self.step and trainer.global_rank == self.rank and first:
            die_after_boundary(trainer.strategy.checkpoint_io.session, self.step, self.signal)


class Report(pl.Callback):
    """One line per rank as training starts: who it is (pid, generation) and what the process holds of earlier
    generations (the pack's threads, plugins, Trainers), so a restart in place can be checked for leftovers."""

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
        gc.collect()
        body = {
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "generation": int(os.environ.get("RESILIENCE_GENERATION", "0")),
            "step": trainer.global_step,
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("resilience")),
            "plugins": len(live_checkpoint_ios()),
            "trainers": sum(isinstance(o, pl.Trainer) for o in gc.get_objects()),
        }
        print(f"START {json.dumps(body)}", flush=True)


def _line(text: str) -> None:
    """One line in one write: the ranks share stdout, and print's text and newline are two writes unbuffered."""
    os.write(1, f"{text}\n".encode())


class ShowBest(pl.Callback):
    """One line per rank for each save (``SAVED``) and as training starts (``RESTORED``): ModelCheckpoint's
    best-k state as this rank holds it (its current score aside, which Lightning does not restore)."""

    @staticmethod
    def _state(trainer: pl.Trainer) -> dict[str, object]:
        best = trainer.checkpoint_callback
        assert isinstance(best, ModelCheckpoint)
        return {
            "best_k_models": {os.path.basename(k): float(v) for k, v in sorted(best.best_k_models.items())},
            "best_model_path": os.path.basename(best.best_model_path),
            "best_model_score": None if best.best_model_score is None else float(best.best_model_score),
            "kth_best_model_path": os.path.basename(best.kth_best_model_path),
        }

    def on_save_checkpoint(self, trainer: pl.Trainer, *args: object) -> None:
        _line(f"SAVED {trainer.global_rank} {trainer.global_step} {json.dumps(self._state(trainer))}")

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
        _line(f"RESTORED {trainer.global_rank} {json.dumps(self._state(trainer))}")


class Sleep(pl.Callback):
    """Slow steps down, so that a test has time to send a signal mid-run: inside the step, as its compute would
    take the time, between the batch's fetch and the step's boundary; or, ``after_boundary``, between the
    boundary and the next fetch, as another callback or validation would."""

    def __init__(self, seconds: float, *, after_boundary: bool = False) -> None:
        self.seconds, self.after_boundary = seconds, after_boundary

    def on_train_batch_start(self, *args: object) -> None:
        if not self.after_boundary:
            time.sleep(self.seconds)

    def on_train_batch_end(self, *args: object) -> None:
        if self.after_boundary:  # after the pack's callbacks, which come first in the list
            time.sleep(self.seconds)


class SlowToLeave(pl.Callback):
    """Rank 0 leaves ``seconds`` later after an error or a stop, as a slow teardown would."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_exception(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 0:
            time.sleep(self.seconds)


def slow_down_survivor_saves(seconds: float) -> None:
    from resilience.recovery import peer_loss

    save = peer_loss.survivor_save

    def slow_save(*args: object, **kwargs: object) -> object:
        time.sleep(seconds)
        return save(*args, **kwargs)  # type: ignore[arg-type]

    peer_loss.survivor_save = slow_save  # type: ignore[assignment]


def main() -> None:
    slow_down_loads_from_env()
    if os.environ.get("TEST_SLOW_SURVIVOR_S"):
        slow_down_survivor_saves(float(os.environ["TEST_SLOW_SURVIVOR_S"]))
    if os.environ.get("TEST_SLOW_WRITE_S"):  # each background write first leaves a marker and waits
        os.environ.update(RESILIENCE_HELPER_PRELOAD="tests.workers.helper_faults", TEST_HELPER_FAULT="slow_write")
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--durable")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32, help="the model's width (about 68 bytes of state per unit)")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--loader", default="stateful", choices=["stateful", "lightning", "plain"])
    p.add_argument("--workers", type=int, default=0, help="the data loader's worker processes")
    p.add_argument("--out", help="write the final parameters here (rank 0)")
    p.add_argument("--ckpt-path", help="pass this ckpt_path to fit()")
    p.add_argument("--async-staging", action="store_true")
    p.add_argument("--health", action="store_true", help="add HealthGuardCallback (faults via RESILIENCE_INJECT)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step, to leave time for a signal")
    p.add_argument("--sleep-after-boundary", action="store_true", help="the step's sleep after its boundary")
    p.add_argument("--no-auto-resume", action="store_true")
    p.add_argument("--victim", help="RANK:STEP:kill|stop, a rank lost mid-run")
    p.add_argument(
        "--monitor",
        action="store_true",
        help="ModelCheckpoint keeps the top 2 by train_loss, which each rank logs from its own batches (no "
        "sync_dist), in file names holding it; ShowBest prints its state",
    )
    p.add_argument("--hang-min-s", type=float, default=10.0, help="the health watchdog's shortest hang")
    p.add_argument("--grace", type=float, default=60.0, help="the health guard's grace_s")
    p.add_argument(
        "--fixed-buckets",
        action="store_true",
        help="DDP with find_unused_parameters, which never rebuilds its gradient buckets: from 3 ranks on, the "
        "bucket layout decides the order gradients are summed in, and a rebuild after a resumed run's first step "
        "would change it (docs/LIGHTNING.md)",
    )
    args = p.parse_args()

    pl.seed_everything(7, workers=True)
    io = ResilientCheckpointIO(
        os.path.join(args.root, "ckpt"),
        durable_url=args.durable,
        storage_options=json.loads(os.environ.get("TEST_STORAGE_OPTIONS", "{}")),
        async_staging=args.async_staging,
        persist="process" if os.environ.get("TEST_SLOW_WRITE_S") else "auto",  # the slow write is the helper's
    )
    names = os.path.join(args.root, "names")
    callbacks: list[pl.Callback] = [
        Report(),
        ModelCheckpoint(
            dirpath=names,
            every_n_train_steps=args.every,
            monitor="train_loss",
            save_top_k=2,
            filename="{step}-{train_loss:.6f}",
        )
        if args.monitor
        else ModelCheckpoint(dirpath=names, every_n_train_steps=args.every, save_top_k=-1),
    ]
    if args.monitor:
        callbacks.append(ShowBest())
    if not args.no_auto_resume:
        callbacks.append(AutoResume())
    if args.kill_at is not None:
        callbacks.append(KillAfter(args.kill_at, io))
    if args.health:
        callbacks.append(HealthGuardCallback(grace_s=args.grace, hang_min_s=args.hang_min_s, hang_min_samples=3))
    if args.victim:
        rank, step, how = args.victim.split(":")
        callbacks.append(Victim(int(rank), int(step), how))
    if os.environ.get("TEST_SLOW_LEAVE_S"):
        callbacks.append(SlowToLeave(float(os.environ["TEST_SLOW_LEAVE_S"])))
    if args.step_sleep:
        callbacks.append(Sleep(args.step_sleep, after_boundary=args.sleep_after_boundary))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=("resilient_ddp_find_unused_parameters_true" if args.fixed_buckets else "resilient_ddp")
        if args.devices > 1
        else "auto",
        plugins=[io],
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=pl.loggers.CSVLogger(args.root, name="logs", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
        deterministic=True,
        use_distributed_sampler=args.loader != "stateful",
    )
    data = DemoData(loader=args.loader, num_workers=args.workers)
    trainer.fit(DemoModel(hidden=args.hidden), data, ckpt_path=args.ckpt_path)
    if args.out and trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}, args.out)
    print(f"FINISHED {trainer.global_step} {trainer.current_epoch}", flush=True)  # one write: ranks share stdout


if __name__ == "__main__":
    main()
