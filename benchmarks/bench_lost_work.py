"""Lost work per failure: a kill -9 of one rank, a hung rank, a preemption notice, ours against Lightning's defaults
(issue 13).

Each job is a 2-rank Lightning DDP fit on CPU (gloo; Lightning's own launcher starts rank 1) of 8 x Linear(w, w)
+ Adam (w from --size-gb), with ``ModelCheckpoint(every_n_train_steps=N)``; each training step also sleeps
--step-s, standing in for accelerator time, so that a step is long enough to be interrupted. Its first launch
meets the failure at the start of step k + 1 (k steps done): rank 1 sends itself SIGKILL ("kill") or SIGSTOP
("hang"), or every rank gets SIGTERM ("preempt", what a scheduler sends before it takes the nodes). Then the
same command is launched again, and the step it restored is read from its first training step. Lost work = k
minus that step: the steps trained again.

- Ours: ``strategy="resilient_ddp"`` with ``ResilientCheckpointIO``, ``AutoResume`` and ``HealthGuardCallback``
  (defaults, but NVML off on CPU and the hang watchdog's shortest hang --hang-s): survivor saves of a lost rank
  and emergency saves on a preemption.
- Lightning's defaults: ``strategy="ddp"``, ``ModelCheckpoint(every_n_train_steps=N, save_last=True)`` and
  ``fit(ckpt_path="last")``. A hung rank hangs its job until the collective's timeout (gloo: 30 min by
  default); here the job is killed after --hang-bound-s, which is then counted as time lost too.

Also per failure: from the failure to the newest commit of the first launch (ours: the survivor or emergency
save; Lightning: nothing is written after the failure), and to the end of the first launch (every process gone).
The failure steps are drawn once (seeded) from (N, 3N) and used by both variants.

    .venv/bin/python -m benchmarks.bench_lost_work [--size-gb 0.05] [--every 10] [--failures 2] [--dir DIR]
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
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Report, Stats, emit, parser, results_in, scratch, setup_torch, width_for, worker_env

OURS, LIGHTNING = "ours", "lightning"
KINDS = ("kill", "hang", "preempt")
FAILED_AT = "failed_at"  # a file per failure: when it happened (time.time())


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch (Lightning's launcher runs this same command line for rank 1)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from benchmarks.bench_lightning import Net, loader, trainer

    root = Path(args.dir)
    failure = args.fail.split("@") if args.fail else None

    class Sleepy(Net):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            time.sleep(args.step_s)
            return super().training_step(batch, batch_idx)

    class Fail(pl.Callback):
        """Reports the step training starts at, and makes the failure at the start of step k + 1."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                emit({"start_step": trainer.global_step})

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if failure is None or trainer.global_step != int(failure[1]):
                return
            kind, rank = failure[0], trainer.global_rank
            if kind == "preempt" or rank == 1:
                (root / f"{FAILED_AT}-{rank}").write_text(str(time.time()))
                os.kill(os.getpid(), {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}.get(kind, signal.SIGTERM))

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                emit({"end_step": trainer.global_step})

    names = ModelCheckpoint(
        dirpath=root / "names", every_n_train_steps=args.every, save_top_k=-1, save_last=args.worker == LIGHTNING
    )
    model = Sleepy(width_for(args.size_gb))
    data = loader(model, args.max_steps)
    if args.worker == OURS:
        from lightning_resilience import AutoResume, HealthGuardCallback, ResilientCheckpointIO

        guard = HealthGuardCallback(nvml=False, hang_min_s=args.hang_s, hang_min_samples=3)
        run = trainer(
            args.max_steps,
            root,
            devices=2,
            strategy="resilient_ddp",
            plugins=[ResilientCheckpointIO(str(root / "ckpt"))],
            callbacks=[names, AutoResume(), guard, Fail()],
        )
        run.fit(model, data)
    else:
        run = trainer(args.max_steps, root, devices=2, strategy="ddp", callbacks=[names, Fail()])
        run.fit(model, data, ckpt_path="last")


def launch(variant: str, root: Path, args: argparse.Namespace, fail: str | None, bound_s: float) -> dict[str, Any]:
    """One launch to its end (one still running after ``bound_s`` is killed, as hung): exit code (None: killed),
    when it started and ended, the worker's reports."""
    command = [sys.executable, "-m", "benchmarks.bench_lost_work", "--worker", variant, "--dir", str(root)]
    command += ["--size-gb", str(args.size_gb), "--every", str(args.every), "--max-steps", str(args.max_steps)]
    command += ["--step-s", str(args.step_s), "--hang-s", str(args.hang_s), "--threads", str(args.threads)]
    command += ["--fail", fail] if fail else []
    log = root / f"launch-{time.monotonic_ns()}.log"
    started = time.time()
    with log.open("w") as sink:  # a file, not a pipe: a stopped rank would hold a pipe open forever
        proc = subprocess.Popen(
            command, cwd=ROOT, env=worker_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            code = None  # hung: what an operator or a job timeout would do, after the bound
        finally:
            with contextlib.suppress(ProcessLookupError):  # whatever is left of the job (a stopped rank 1)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ended = time.time()
    output = log.read_text()
    reports = {k: v for result in results_in(output) for k, v in result.items()}
    return {"code": code, "started": started, "ended": ended, "output": output, **reports}


def newest_commit_time(root: Path) -> float | None:
    """When the newest committed checkpoint of the run was committed (its manifest's modification time)."""
    manifests = sorted((root / "ckpt").glob("step-*/manifest.json"), key=lambda p: int(p.parent.name[5:]))
    return manifests[-1].stat().st_mtime if manifests else None


def trial(variant: str, kind: str, step: int, parent: Path, args: argparse.Namespace) -> dict[str, Any]:
    root = parent / f"{variant}-{kind}-{step}"
    root.mkdir()
    first = launch(variant, root, args, f"{kind}@{step}", args.hang_bound_s)
    failed = [float(p.read_text()) for p in root.glob(f"{FAILED_AT}-*")]
    if not failed:
        raise RuntimeError(f"{variant} {kind}@{step}: the failure never happened:\n{first['output'][-4000:]}")
    failed_at = min(failed)
    committed = newest_commit_time(root) if variant == OURS else None
    again = launch(variant, root, args, None, 600)
    if again["code"] != 0 or again.get("end_step") != args.max_steps:
        raise RuntimeError(f"{variant} {kind}@{step}: the relaunch did not finish:\n{again['output'][-4000:]}")
    restored = int(again["start_step"])
    return {
        "lost_steps": max(0, step - restored),  # a stop at the next boundary finishes the step in progress
        "restored": restored,
        "first_exit": first["code"],
        "to_commit_s": committed - failed_at if committed is not None and committed > failed_at else None,
        "to_exit_s": first["ended"] - failed_at,
    }


def main() -> None:
    p = parser(__doc__, size_gb=0.05, repeats=1)
    p.add_argument("--every", type=int, default=10, help="ModelCheckpoint's every_n_train_steps (default 10)")
    p.add_argument("--failures", type=int, default=2, help="failure steps per kind (default %(default)s)")
    p.add_argument("--step-s", type=float, default=0.2, help="sleep per training step (default %(default)s)")
    p.add_argument("--hang-s", type=float, default=5.0, help="ours: the watchdog's shortest hang (default 5)")
    p.add_argument("--hang-bound-s", type=float, default=60.0, help="a first launch running longer is killed")
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--max-steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fail", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=(OURS, LIGHTNING), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.max_steps = args.max_steps or 3 * args.every + 5
    setup_torch(args.threads)
    if args.worker:
        worker(args)
        return

    steps = random.Random(args.seed).sample(range(args.every + 1, 3 * args.every), args.failures)
    report = Report(
        "Lost work per failure: kill -9, hang, preemption (issue 13)",
        f"2-rank Lightning DDP on CPU, 8 x Linear({width_for(args.size_gb)}) + Adam ({args.size_gb} GB), "
        f"ModelCheckpoint(every_n_train_steps={args.every}), {args.step_s} s of sleep per step, failures at the "
        f"start of steps {', '.join(str(s + 1) for s in steps)} (after {', '.join(map(str, steps))} steps); a hung "
        f"job is killed after {args.hang_bound_s:.0f} s",
    )
    rows, raw = [], {}
    with scratch(args.dir, "lost-work") as parent:
        for kind in KINDS:
            for variant in (OURS, LIGHTNING):
                results = [trial(variant, kind, step, parent, args) for step in steps]
                raw[f"{variant}-{kind}"] = results
                lost = Stats.of(r["lost_steps"] for r in results)
                commits = [r["to_commit_s"] for r in results if r["to_commit_s"] is not None]
                rows.append(
                    (
                        kind,
                        "ours" if variant == OURS else "Lightning's defaults",
                        ", ".join(
                            f"{r['lost_steps']} ({step} -> {r['restored']})"
                            for r, step in zip(results, steps, strict=True)
                        ),
                        f"{lost.median:.1f}",
                        ", ".join(f"{c:.1f}" for c in commits) if commits else "no commit after the failure",
                        ", ".join(f"{r['to_exit_s']:.1f}" for r in results),
                        ", ".join(str(r["first_exit"]) for r in results),
                    )
                )
    report.table(
        [
            "failure",
            "variant",
            "steps lost (done -> restored), each failure",
            "median",
            "failure to commit (s)",
            "failure to every process gone (s)",
            "first launch's exit code",
        ],
        rows,
    )
    report.add(
        "Exit code None: the first launch was still running at the bound and was killed (hung). Lost steps are "
        "trained again after the relaunch; a hung job also loses the time until it is killed. With failures "
        f"uniform over the steps, Lightning's defaults lose {(args.every - 1) / 2:.1f} steps on average, half an "
        "interval."
    )
    report.print()
    print(f"<!-- raw: {json.dumps(raw)} -->")


if __name__ == "__main__":
    main()
