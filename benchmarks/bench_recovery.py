"""Recovery from a lost rank: restart in place against a full relaunch and Lightning's defaults (issue 17).

Each job is a 2-rank Lightning DDP fit on CPU (gloo) of 8 x Linear(w, w) + Adam (w from --size-gb) on a plain
DataLoader, saving every --every steps; each step also sleeps --step-s, standing in for accelerator time (the
CPU is free meanwhile), so that 800 steps take a few minutes and meet several failures. Three ways back after
rank 1 is SIGKILLed:

- ``in place``: ours (``strategy="resilient_ddp"``, ``ResilientCheckpointIO``, ``AutoResume``,
  ``PeriodicCheckpoint``) under ``resilience launch``: the survivor saves the last completed step, a warm spare
  takes rank 1, and rank 0's process runs the script again (docs/RECOVERY.md).
- ``relaunch``: the same job under Lightning's own launcher: the survivor saves and exits 75, and the same
  command is launched again at once (what torchrun's agent or a scheduler would do).
- ``Lightning``: Lightning's defaults, ``strategy="ddp"``, ``ModelCheckpoint(every_n_train_steps=N,
  save_last=True)`` and ``fit(ckpt_path="last")``, launched again at once after the crash.

Two measurements, each variant in turn:

1. ``--part first-step``: rank 1 kills itself at the start of step k + 1 (k drawn from (N, 2N), seeded); from the
   kill to the first step done after it, and to new progress (step k + 1 done: Lightning's defaults first redo the
   steps since their last save).
2. ``--part goodput``: --steps steps, with rank 1 SIGKILLed from outside about every --fail-every-s seconds of wall
   time (the same seeded schedule for every variant), relaunched at once until the last step; and the same run
   without failures. Goodput = the variant's wall time without failures over its wall time with them; the
   table also gives every wall time over the fastest run without failures, a yardstick common to all.

Rank 0 appends each step's end (time, step, generation) to ``events.jsonl``; every rank writes its pid.

    .venv/bin/python -m benchmarks.bench_recovery [--part first-step|goodput|both] [--size-gb 0.17] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Report, Stats, parser, scratch, setup_torch, width_for, worker_env
from resilience.goodput.report import RECOVERY_HEADS
from resilience.goodput.summary import RECOVERY_PARTS, summarize

IN_PLACE, RELAUNCH, LIGHTNING = "in place", "relaunch", "Lightning"
VARIANTS = (IN_PLACE, RELAUNCH, LIGHTNING)
EVENTS = "events.jsonl"
FAILED_AT = "failed_at"


def _append(path: Path, record: dict[str, Any]) -> None:
    """One write of one line (O_APPEND): a kill never leaves half a record behind another."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch (Lightning's launcher, or ``resilience launch``, runs it)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from benchmarks.bench_lightning import Net, loader, trainer

    root = Path(args.dir)
    generation = int(os.environ.get("RESILIENCE_GENERATION", "0"))

    class Marks(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
            tmp = root / f"pid-{trainer.global_rank}.tmp"
            tmp.write_text(str(os.getpid()))
            tmp.replace(root / f"pid-{trainer.global_rank}")

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            first = generation == 0 and not (root / FAILED_AT).exists()
            if args.fail_at is not None and first and trainer.global_step == args.fail_at and trainer.global_rank == 1:
                (root / FAILED_AT).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.is_global_zero:
                _append(root / EVENTS, {"t": time.time(), "step": trainer.global_step, "generation": generation})

    class Sleepy(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            time.sleep(args.step_s)  # accelerator time: the CPU is free meanwhile, as while a GPU computes
            return super().training_step(batch, batch_idx)

    model = Sleepy(width_for(args.size_gb))
    data = loader(model, args.steps)
    if args.worker == LIGHTNING:
        names = [ModelCheckpoint(dirpath=root / "names", every_n_train_steps=args.every, save_last=True)]
        names = [] if args.no_saves else names
        run = trainer(args.steps, root, devices=2, strategy="ddp", callbacks=[*names, Marks()])
        run.fit(model, data, ckpt_path=None if args.no_saves else "last")
        return
    from lightning_resilience import (
        AutoResume,
        GoodputMonitor,
        HealthGuardCallback,
        PeriodicCheckpoint,
        ResilientCheckpointIO,
    )

    callbacks: list[pl.Callback] = [AutoResume(), GoodputMonitor(), Marks()]
    callbacks += [] if args.no_saves else [PeriodicCheckpoint(every_n_steps=args.every)]
    callbacks += [HealthGuardCallback()] if args.health else []
    io = ResilientCheckpointIO(str(root / "ckpt"))
    run = trainer(args.steps, root, devices=2, strategy="resilient_ddp", plugins=[io], callbacks=callbacks)
    run.fit(model, data)


class Job:
    """One variant's run to its last step: launched (again after each failure), killed on a schedule."""

    def __init__(
        self,
        variant: str,
        root: Path,
        args: argparse.Namespace,
        fail_at: int | None = None,
        extra: Sequence[str] = (),
    ):
        self.variant, self.root, self.args, self.fail_at = variant, root, args, fail_at
        self.extra = list(extra)  # more worker arguments (--health, --no-saves)
        self.proc: subprocess.Popen[bytes] | None = None
        self.launches = 0

    def command(self, first: bool) -> list[str]:
        worker = ["-m", "benchmarks.bench_recovery", "--worker", LIGHTNING if self.variant == LIGHTNING else "ours"]
        worker += ["--dir", str(self.root), "--size-gb", str(self.args.size_gb), "--every", str(self.args.every)]
        worker += [
            "--steps",
            str(self.args.steps),
            "--threads",
            str(self.args.threads),
            "--step-s",
            str(self.args.step_s),
        ]
        if first and self.fail_at is not None:
            worker += ["--fail-at", str(self.fail_at)]
        worker += self.extra
        if self.variant == IN_PLACE:
            return [
                sys.executable,
                "-m",
                "resilience.cli",
                "launch",
                "--nproc-per-node=2",
                "--max-restarts=100",
                "--",
                *worker,
            ]
        return [sys.executable, *worker]

    def run(self, bound_s: float) -> float:
        """Launch until the last step is done; the wall time from the first launch to the end."""
        started = time.time()
        first = True
        while True:
            self.launches += 1
            with (self.root / f"launch-{self.launches}.log").open("w") as sink:
                self.proc = subprocess.Popen(
                    self.command(first),
                    cwd=ROOT,
                    env=worker_env(),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    code = self.proc.wait(timeout=max(1.0, started + bound_s - time.time()))
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
            first = False
            if code == 0 and self.last_step() >= self.args.steps:
                return time.time() - started
            if time.time() - started > bound_s:
                raise RuntimeError(f"{self.variant}: not done in {bound_s:.0f} s; see {self.root}")

    def run_with_faults(
        self, schedule: Sequence[float], bound_s: float, fault: Callable[[int], bool]
    ) -> tuple[float, list[tuple[int, float]]]:
        """:meth:`run`, with ``fault(index)`` called at each time of ``schedule`` (seconds from the start), again
        every 0.2 s until it says it struck (the job is starting up meanwhile); the wall time and when each fault
        struck."""
        struck: list[tuple[int, float]] = []
        done = threading.Event()

        def deliver() -> None:
            began = time.time()
            for index, at in enumerate(schedule):
                while time.time() - began < at:
                    if done.wait(0.05):
                        return
                while not done.is_set():
                    if fault(index):
                        struck.append((index, time.time() - began))
                        break
                    time.sleep(0.2)

        thread = threading.Thread(target=deliver, daemon=True)
        thread.start()
        try:
            wall = self.run(bound_s=bound_s)
        finally:
            done.set()
            thread.join()
        return wall, struck

    def kill_rank_1(self) -> bool:
        """SIGKILL rank 1's current process, if the job is training; whether it was."""
        try:
            pid = int((self.root / "pid-1").read_text())
        except (OSError, ValueError):
            return False
        if self.proc is None or self.proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            (self.root / "pid-1").unlink(missing_ok=True)
            return True
        return False

    def events(self) -> list[dict[str, Any]]:
        path = self.root / EVENTS
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def last_step(self) -> int:
        return max((e["step"] for e in self.events()), default=0)


def first_step_trial(variant: str, k: int, parent: Path, args: argparse.Namespace) -> dict[str, float]:
    root = parent / f"first-{variant.replace(' ', '-')}-{k}"
    root.mkdir()
    job = Job(variant, root, args, fail_at=k)
    job.run(bound_s=900)
    failed_at = float((root / FAILED_AT).read_text())
    after = [e for e in job.events() if e["t"] > failed_at]
    first = min(after, key=lambda e: e["t"])
    progress = min((e for e in after if e["step"] > k), key=lambda e: e["t"])
    parts: dict[str, float] = {}
    if variant != LIGHTNING:  # ours: the goodput ledger's account of the restart (rank 0's)
        last = summarize(root).incarnations[-1]
        parts = {"how": last.restart, "down_s": last.downtime_before_s, **last.recovery}  # type: ignore[dict-item]
    return {
        "to_first_step_s": first["t"] - failed_at,
        "first_step": first["step"],
        "to_progress_s": progress["t"] - failed_at,
        **parts,
    }


def goodput_run(variant: str, parent: Path, args: argparse.Namespace, schedule: list[float] | None) -> dict[str, Any]:
    root = parent / f"goodput-{variant.replace(' ', '-')}-{'failures' if schedule else 'clean'}"
    root.mkdir()
    job = Job(variant, root, args)
    wall, kills = job.run_with_faults(schedule or [], args.bound_s, lambda index: job.kill_rank_1())
    return {"wall_s": wall, "kills": len(kills), "launches": job.launches}


def main() -> None:
    p = parser(__doc__, size_gb=0.17, repeats=2)
    p.add_argument("--part", choices=("first-step", "goodput", "both"), default="both")
    p.add_argument("--every", type=int, default=50, help="a save every N steps (default %(default)s)")
    p.add_argument("--steps", type=int, default=800, help="steps of the goodput run (default %(default)s)")
    p.add_argument("--fail-every-s", type=float, default=60.0, help="goodput run: a kill about this often")
    p.add_argument("--step-s", type=float, default=0.25, help="sleep per step, for accelerator time (default 0.25)")
    p.add_argument("--bound-s", type=float, default=3600.0, help="a variant's goodput run may take this long")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--worker", choices=("ours", LIGHTNING), help=argparse.SUPPRESS)
    p.add_argument("--fail-at", type=int, help=argparse.SUPPRESS)
    p.add_argument("--health", action="store_true", help=argparse.SUPPRESS)  # ours: HealthGuardCallback too
    p.add_argument("--no-saves", action="store_true", help=argparse.SUPPRESS)  # neither saves nor resumes
    args = p.parse_args()
    setup_torch(args.threads)
    if args.worker:
        worker(args)
        return
    rng = random.Random(args.seed)
    width = width_for(args.size_gb)
    report = Report(
        "Recovery from a lost rank: restart in place, relaunch, Lightning's defaults (issue 17)",
        f"2-rank Lightning DDP on CPU (gloo), 8 x Linear({width}) + Adam ({args.size_gb} GB of state), a plain "
        f"DataLoader, a save every {args.every} steps, {args.step_s} s of sleep per step; rank 1 SIGKILLed",
    )
    goodput_steps = args.steps
    with scratch(args.dir, "recovery") as parent:
        if args.part in ("first-step", "both"):
            args.steps = 3 * args.every
            ks = rng.sample(range(args.every + 1, 2 * args.every), args.repeats)
            rows, ledger_rows = [], []
            for variant in VARIANTS:
                trials = [first_step_trial(variant, k, parent, args) for k in ks]
                ledger_rows += [
                    (variant, t["how"], *(f"{t[part]:.2f}" for part in ("down_s", *RECOVERY_PARTS)))
                    for t in trials
                    if "how" in t
                ]
                first = Stats.of(t["to_first_step_s"] for t in trials)
                progress = Stats.of(t["to_progress_s"] for t in trials)
                rows.append(
                    (
                        variant,
                        ", ".join(f"{t['to_first_step_s']:.1f} (step {t['first_step']})" for t in trials),
                        f"{first.median:.1f}",
                        ", ".join(f"{t['to_progress_s']:.1f}" for t in trials),
                        f"{progress.median:.1f}",
                    )
                )
            report.heading(f"Kill -9 of rank 1 at the start of step k + 1, k in {ks}: time back to training")
            report.table(
                [
                    "variant",
                    "kill to first step done, s (its step)",
                    "median",
                    "kill to new progress (step k + 1 done), s",
                    "median",
                ],
                rows,
            )
            report.add("The same restarts as rank 0's goodput ledger splits them (`resilience report`), seconds:")
            report.table(["variant", "how", "down", *(h.lower() for h in RECOVERY_HEADS)], ledger_rows)
            report.add(
                "The ledger counts from the previous incarnation's last record (the survivor save's end), so its "
                "parts add up to less than the time from the kill; `down` in place is the framework's teardown and "
                "the wait for the spare, `start-up` the script's second run up to training (Trainer, process group)."
            )
        if args.part in ("goodput", "both"):
            args.steps = goodput_steps
            schedule, at = [], 0.0
            while at < args.bound_s:
                at += rng.uniform(0.75, 1.25) * args.fail_every_s
                schedule.append(at)
            runs = {
                (variant, failing): goodput_run(variant, parent, args, schedule if failing else None)
                for variant in VARIANTS
                for failing in (False, True)
            }
            fastest = min(r["wall_s"] for (_, failing), r in runs.items() if not failing)
            rows = []
            for variant in VARIANTS:
                clean, failed = runs[variant, False], runs[variant, True]
                rows.append(
                    (
                        variant,
                        f"{clean['wall_s']:.0f}",
                        f"{failed['wall_s']:.0f}",
                        failed["kills"],
                        f"{clean['wall_s'] / failed['wall_s']:.2f}",
                        f"{fastest / failed['wall_s']:.2f}",
                    )
                )
            ours = runs[IN_PLACE, False]["wall_s"] / runs[IN_PLACE, True]["wall_s"]
            theirs = runs[LIGHTNING, False]["wall_s"] / runs[LIGHTNING, True]["wall_s"]
            report.heading(
                f"{args.steps} steps, rank 1 SIGKILLed about every {args.fail_every_s:.0f} s (seed {args.seed})"
            )
            report.table(
                [
                    "variant",
                    "wall without failures, s",
                    "wall with failures, s",
                    "kills",
                    "goodput (own wall without failures / with)",
                    "fastest wall without failures / with",
                ],
                rows,
            )
            report.add(f"Goodput in place over Lightning's defaults: {ours / theirs:.2f}x.")
    report.print()


if __name__ == "__main__":
    main()
