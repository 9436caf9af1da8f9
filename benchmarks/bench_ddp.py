"""2-rank DDP under Lightning: bytes each rank writes and time to commit, ours against rank-0-only torch.save.

Each variant is one 2-process Lightning job (``devices=2`` on CPU, gloo), launched in turns: ours with
``strategy="resilient_ddp"`` (every rank writes its share of a deduplicated DCP checkpoint) and stock
``strategy="ddp"`` with Lightning's TorchCheckpointIO (rank 0 writes everything with torch.save while rank 1
waits at the barrier). Each job trains and saves every 2nd step; time to commit = from the
``trainer.save_checkpoint`` call until the checkpoint is complete (ours: the manifest is written, waited for
right after the call; torch.save: the call's return, after Lightning's barrier). Bytes per rank come from
the committed manifests (``files[].rank``, ``files[].size``) and, for torch.save, from the file rank 0 wrote.

    .venv/bin/python -m benchmarks.bench_ddp [--size-gb 1.6] [--saves 3] [--repeats 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import (
    GB,
    LAYERS,
    Report,
    Stats,
    emit,
    now,
    parse,
    parser,
    ratio,
    rotated,
    run_worker,
    scratch,
    verdict,
    width_for,
)

OURS, TORCH = "ours, strategy='resilient_ddp'", "torch.save on rank 0, strategy='ddp'"
SHARE_TOLERANCE = 0.25


def worker(variant: str, size_gb: float, saves: int, root: Path) -> None:
    import lightning.pytorch as pl

    from benchmarks.bench_lightning import Net, drain, loader, trainer
    from lightning_resilience import ResilientCheckpointIO

    class CommitTimes(pl.Callback):
        def __init__(self) -> None:
            self.samples: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step % 2:
                return
            start = now()
            trainer.save_checkpoint(str(root / f"step={trainer.global_step}.ckpt"))
            block = now() - start
            drain(trainer.strategy.checkpoint_io)
            self.samples.append({"block": block, "commit": now() - start})

    ours = variant == OURS
    io = ResilientCheckpointIO(str(root / "ours"), keep_last=saves + 1) if ours else None
    times = CommitTimes()
    run = trainer(
        2 * saves,
        root,
        devices=2,
        strategy="resilient_ddp" if ours else "ddp",
        plugins=[io] if io is not None else None,
        callbacks=[times],
    )
    model = Net(width_for(size_gb))
    run.fit(model, loader(model, 2 * saves))
    emit({"rank": run.global_rank, "samples": times.samples})


def written(root: Path, variant: str) -> list[dict[int, int]]:
    """Bytes each rank wrote, per checkpoint."""
    if variant == TORCH:
        return [{0: path.stat().st_size, 1: 0} for path in sorted(root.glob("step=*.ckpt"))]
    per_save = []
    for manifest in sorted((root / "ours").glob("step-*/manifest.json")):
        split: dict[int, int] = {0: 0, 1: 0}
        for entry in json.loads(manifest.read_text())["files"]:
            split[entry["rank"]] += entry["size"]
        per_save.append(split)
    return per_save


def main() -> None:
    p = parser(__doc__, repeats=1)
    p.add_argument("--saves", type=int, default=3, help="saves per job (default %(default)s)")
    p.add_argument("--worker", choices=(OURS, TORCH), help=argparse.SUPPRESS)
    args = parse(p)
    if args.worker:
        worker(args.worker, args.size_gb, args.saves, Path(args.dir))
        return

    width = width_for(args.size_gb)
    report = Report(
        "2-rank DDP: bytes per rank and time to commit (item 4; issue 3)",
        f"Lightning, 2 CPU processes (gloo) on this machine, {LAYERS} x Linear({width}, {width}) + Adam "
        f"(about {args.size_gb} GB); {args.saves} saves per job, every 2nd step; {args.repeats} job(s) per "
        "variant in turns; median [IQR] in seconds",
    )
    samples: dict[str, list[dict[str, Any]]] = {OURS: [], TORCH: []}
    splits: dict[str, list[dict[int, int]]] = {OURS: [], TORCH: []}
    with scratch(args.dir, "ddp") as root:
        for round_ in range(args.repeats):
            for variant in rotated([OURS, TORCH], round_):
                directory = root / f"{round_}-{len(splits[variant])}-{variant.split(',')[0].split()[0]}"
                directory.mkdir()
                results, _ = run_worker(
                    "benchmarks.bench_ddp",
                    [
                        *("--worker", variant, "--size-gb", str(args.size_gb), "--saves", str(args.saves)),
                        *("--dir", str(directory), "--threads", str(args.threads)),
                    ],
                    timeout=300 + 120 * args.saves * max(1.0, args.size_gb),
                )
                samples[variant] += [dict(s, rank=r["rank"]) for r in results for s in r["samples"]]
                splits[variant] += written(directory, variant)

    rows, shares = [], {}
    for variant in (OURS, TORCH):
        rank0 = [s for s in samples[variant] if s["rank"] == 0]
        totals = [sum(split.values()) for split in splits[variant]]
        share = [split[rank] / total for split, total in zip(splits[variant], totals, strict=True) for rank in (0, 1)]
        shares[variant] = share
        rows.append(
            [
                variant,
                Stats.of(s["block"] for s in rank0).fmt(),
                Stats.of(s["commit"] for s in rank0).fmt(),
                f"{Stats.of(totals).median / GB:.3f}",
                " / ".join(f"{Stats.of(split[rank] for split in splits[variant]).median / GB:.3f}" for rank in (0, 1)),
                f"{min(share):.1%} - {max(share):.1%}",
            ]
        )
    report.table(
        [
            "variant",
            "blocking per save (rank 0)",
            "time to commit (rank 0)",
            "GB per checkpoint",
            "GB written by rank 0 / rank 1",
            "rank shares (min - max)",
        ],
        rows,
    )
    balanced = all(abs(s - 0.5) <= SHARE_TOLERANCE * 0.5 for s in shares[OURS])
    commit = {v: Stats.of(s["commit"] for s in samples[v] if s["rank"] == 0).median for v in (OURS, TORCH)}
    report.add(
        f"- Target: under DDP with 2 ranks each rank writes within 25% of half the bytes (37.5%-62.5%), every "
        f"checkpoint: {verdict(balanced)}."
    )
    report.add(
        f"- Time to commit, torch.save on rank 0 / ours: {ratio(commit[TORCH], commit[OURS]):.2f}x. Both ranks "
        "share this machine's 2 cores and one disk, so parallel writes cannot add bandwidth here; on separate "
        "hosts or disks each rank's half is written concurrently. torch.save does not fsync; ours does."
    )
    report.print()


if __name__ == "__main__":
    main()
