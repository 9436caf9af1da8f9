"""Goodput under the failures users meet: preemptions and crashes, alternating, about once a minute.

The job is :mod:`benchmarks.bench_recovery`'s: a 2-rank Lightning DDP fit on CPU (gloo) of 8 x Linear(w, w) + Adam
(170 MB of state by default), --steps steps of --step-s sleep each (accelerator time), a save every --every steps.
Faults come on one seeded schedule of wall time, about every --fail-every-s seconds, and alternate:

- a preemption: SIGTERM to every process of the job (its process group: launcher, ranks, helpers, spares), SIGKILL
  to the group --kill-after-s later if any is left, and the same command launched again once the job is gone, as a
  scheduler requeues a job;
- a crash: SIGKILL of rank 1's process.

Two ways to run the job:

- ``ours``: ``resilience launch`` with ``ResilientCheckpointIO``, ``AutoResume``, ``PeriodicCheckpoint``,
  ``HealthGuardCallback`` (a stop signal: every rank saves the step and exits 75) and ``GoodputMonitor``. A crash
  is a restart in place from the survivors' save; a preemption a relaunch from the stop's save.
- ``Lightning``: Lightning's defaults, ``ModelCheckpoint(every_n_train_steps=N, save_last=True)`` and
  ``fit(ckpt_path="last")`` under Lightning's own launcher, launched again at once after either fault.

Goodput = the wall time of the same job run once without failures or saves (each way its own) over its wall time
with the faults. Ours' goodput ledger splits each restart into its phases, as ``resilience report`` does.

    .venv/bin/python -m benchmarks.bench_downtime [--size-gb 0.17] [--steps 800] [--fail-every-s 60] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.bench_recovery import IN_PLACE, LIGHTNING, Job
from benchmarks.common import Report, parser, scratch, width_for
from resilience.goodput.report import RECOVERY_HEADS
from resilience.goodput.summary import RECOVERY_PARTS, summarize

OURS = "ours (resilience launch)"
WAYS = {OURS: IN_PLACE, LIGHTNING: LIGHTNING}  # bench_recovery's names for the two launches
PREEMPTION, CRASH = "preemption", "crash"


class FaultyJob(Job):
    """A job that can also be preempted: its whole process group signalled, as a scheduler stops a job."""

    def training(self) -> bool:
        """Both ranks of the current launch have started training (each wrote its pid at the start)."""
        alive = self.proc is not None and self.proc.poll() is None
        return alive and all((self.root / f"pid-{rank}").exists() for rank in (0, 1))

    def preempt(self, kill_after_s: float) -> bool:
        """SIGTERM to every process of the job; SIGKILL to the group ``kill_after_s`` later if any is left;
        whether the job was training."""
        proc = self.proc
        if proc is None or not self.training():
            return False
        for rank in (0, 1):
            (self.root / f"pid-{rank}").unlink(missing_ok=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(kill_after_s)
            return True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return True

    def crash(self) -> bool:
        """SIGKILL of rank 1, if the job is training; whether it was."""
        return self.training() and self.kill_rank_1()


def faulty_run(way: str, parent: Path, args: argparse.Namespace, schedule: list[float] | None) -> dict[str, Any]:
    """One run to the last step: with the faults of ``schedule`` (None: no faults and no saves)."""
    root = parent / f"{way.split()[0].lower()}-{'faults' if schedule else 'clean'}"
    root.mkdir()
    extra = ["--no-saves"] if schedule is None else (["--health"] if way == OURS else [])
    job = FaultyJob(WAYS[way], root, args, extra=extra)
    kinds = [PREEMPTION if index % 2 == 0 else CRASH for index in range(len(schedule or []))]

    def fault(index: int) -> bool:
        return job.preempt(args.kill_after_s) if kinds[index] == PREEMPTION else job.crash()

    wall, struck = job.run_with_faults(schedule or [], args.bound_s, fault)
    delivered = [(kinds[index], at) for index, at in struck]
    return {"wall_s": wall, "faults": delivered, "launches": job.launches, "root": root}


def restarts(root: Path) -> list[dict[str, Any]]:
    """Rank 0's ledger of ours' run: each restart's way back (``in place`` or ``relaunch``) and its parts."""
    return [
        {"how": inc.restart, "down_s": inc.downtime_before_s, **inc.recovery}
        for inc in summarize(root).incarnations[1:]
        if inc.restart is not None
    ]


def main() -> None:
    p = parser(__doc__, size_gb=0.17, repeats=1)
    p.add_argument("--every", type=int, default=50, help="a save every N steps (default %(default)s)")
    p.add_argument("--steps", type=int, default=800, help="steps of each run (default %(default)s)")
    p.add_argument("--fail-every-s", type=float, default=60.0, help="a fault about this often (default 60)")
    p.add_argument("--kill-after-s", type=float, default=20.0, help="a preemption's SIGKILL after its SIGTERM")
    p.add_argument("--step-s", type=float, default=0.25, help="sleep per step, for accelerator time (default 0.25)")
    p.add_argument("--bound-s", type=float, default=3600.0, help="a run may take this long")
    p.add_argument("--seed", type=int, default=50)
    p.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS))
    args = p.parse_args()
    rng = random.Random(args.seed)
    schedule, at = [], 0.0
    while at < args.bound_s:
        at += rng.uniform(0.75, 1.25) * args.fail_every_s
        schedule.append(at)
    report = Report(
        "Goodput under preemptions and crashes, alternating",
        f"2-rank Lightning DDP on CPU (gloo), 8 x Linear({width_for(args.size_gb)}) + Adam ({args.size_gb} GB of "
        f"state), {args.steps} steps of {args.step_s} s sleep each, a save every {args.every} steps; a fault about "
        f"every {args.fail_every_s:.0f} s (seed {args.seed}), preemption (SIGTERM to the job's process group, "
        f"SIGKILL {args.kill_after_s:.0f} s later, relaunch) and crash (SIGKILL of rank 1) in turn",
    )
    with scratch(args.dir, "downtime") as parent:
        runs = {
            (way, faulty): faulty_run(way, parent, args, schedule if faulty else None)
            for way in args.ways
            for faulty in (False, True)
        }
        rows = []
        for way in args.ways:
            clean, faulty = runs[way, False], runs[way, True]
            kinds = [kind for kind, _ in faulty["faults"]]
            lost = (faulty["wall_s"] - clean["wall_s"]) / max(1, len(kinds))
            rows.append(
                (
                    way,
                    f"{clean['wall_s']:.0f}",
                    f"{faulty['wall_s']:.0f}",
                    f"{kinds.count(PREEMPTION)} + {kinds.count(CRASH)}",
                    f"{lost:.1f}",
                    f"{clean['wall_s'] / faulty['wall_s']:.3f}",
                )
            )
        report.table(
            [
                "way",
                "wall without faults or saves, s",
                "wall with faults, s",
                "preemptions + crashes",
                "seconds lost per fault",
                "goodput",
            ],
            rows,
        )
        if OURS in args.ways:
            split = restarts(runs[OURS, True]["root"])
            report.add("Ours' restarts as rank 0's goodput ledger splits them (`resilience report`), seconds:")
            report.table(
                ["how", "down", *(h.lower() for h in RECOVERY_HEADS)],
                [(r["how"], *(f"{r[k]:.2f}" for k in ("down_s", *RECOVERY_PARTS))) for r in split],
            )
            for how in sorted({r["how"] for r in split}):
                mine = [r for r in split if r["how"] == how]
                parts = ", ".join(f"{k} {median(r[k] for r in mine):.2f}" for k in ("down_s", *RECOVERY_PARTS))
                report.add(f"- median of {len(mine)} {how}: {parts}")
            report.add(f"- faults delivered at (s): {[(k, round(t)) for k, t in runs[OURS, True]['faults']]}")
    report.print()


if __name__ == "__main__":
    main()
