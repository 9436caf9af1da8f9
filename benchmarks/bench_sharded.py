"""FSDP2 under Lightning on 2 ranks: how long each save stops training, ours against ModelParallelStrategy's own
synchronous DCP save, and the bytes each rank writes (issue 14).

Each variant is one 2-process Lightning job (``devices=2`` on CPU, gloo) training 8 x Linear(w, w) + Adam
sharded by ``fully_shard`` in ``configure_model`` (w from --size-gb; 1.6 GB gives w = 4096), the variants in
turns: Lightning's ``ModelParallelStrategy(data_parallel_size=2)``, which saves with a synchronous
``torch.distributed.checkpoint.save`` on every rank, and ours, ``ResilientModelParallelStrategy`` with
asynchronous (and, as a third variant, synchronous) staging. Saves go through ``trainer.save_checkpoint`` from a
callback every 2nd step; blocking = the wall time of that call on rank 0, plus for ours the wait the engine's
optimizer pre-step hook makes the next ``optimizer.step()`` do (the engine's counters). At the end of the step
after a save the callback waits for that save to complete (not counted), so each save is timed on its own; the
first save of a job (ours allocates the reused buffers then) is reported apart. Bytes per rank: our committed
manifests (``files[].rank``); for Lightning's save, the sizes of its per-rank shard files.

    .venv/bin/python -m benchmarks.bench_sharded [--size-gb 1.6] [--saves 4] [--repeats 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
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

STOCK, ASYNC, SYNC = (
    "ModelParallelStrategy (Lightning's own DCP save)",
    "ours, async staging",
    "ours, sync staging",
)
SHARE_TOLERANCE = 0.10
TARGET = 20.0


def worker(variant: str, size_gb: float, saves: int, root: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from benchmarks.bench_lightning import Net, loader, trainer
    from lightning_resilience import ResilientCheckpointIO, ResilientModelParallelStrategy

    class ShardedNet(Net):
        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    class TimedSaves(pl.Callback):
        def __init__(self, io: ResilientCheckpointIO | None) -> None:
            self.io = io
            self.samples: list[dict[str, float]] = []
            self._waited = 0.0
            self._pending: Path | None = None

        def _wait_s(self) -> float:
            return self.io.manager.stats.staging_wait_s if self.io is not None else 0.0

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if self._pending is not None:
                sample = self.samples[-1]
                sample["wait"] = self._wait_s() - self._waited
                sample["block"] += sample["wait"]
                if self.io is not None:
                    self.io.manager.wait()
                else:  # Lightning's save is complete when its call returns; keep the disk to one checkpoint
                    trainer.strategy.barrier()
                    if trainer.is_global_zero:
                        sample["bytes"] = {r: (self._pending / f"__{r}_0.distcp").stat().st_size for r in (0, 1)}
                        shutil.rmtree(self._pending)
                self._pending = None
            if trainer.global_step % 2 == 0 and len(self.samples) < saves:
                path = root / f"step={trainer.global_step}.ckpt"
                self._waited = self._wait_s()
                start = now()
                trainer.save_checkpoint(path)
                block = now() - start
                sample = {"block": block, "wait": 0.0, "call": block}
                if self.io is not None:
                    handle = self.io.manager.saved(trainer.global_step)
                    assert handle is not None
                    handle.committed.add_done_callback(lambda _: sample.update(commit=now() - start))
                self.samples.append(sample)
                self._pending = path

    ours = variant != STOCK
    io = ResilientCheckpointIO(str(root / "ours"), keep_last=2, async_staging=variant == ASYNC) if ours else None
    strategy = (
        ResilientModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, checkpoint_io=io)
        if ours
        else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    )
    times = TimedSaves(io)
    run = trainer(2 * saves + 1, root, devices=2, strategy=strategy, callbacks=[times])
    model = ShardedNet(width_for(size_gb))
    run.fit(model, loader(model, 2 * saves + 1))
    if ours:
        for sample, manifest in zip(times.samples, sorted(root.glob("ours/step-*/manifest.json")), strict=False):
            sample["bytes"] = written(manifest)
    emit({"rank": run.global_rank, "samples": times.samples})


def written(manifest: Path) -> dict[int, int]:
    """Shard bytes each rank wrote in a committed checkpoint."""
    split = {0: 0, 1: 0}
    for entry in json.loads(manifest.read_text())["files"]:
        if entry["kind"] == "shard":
            split[entry["rank"]] += entry["size"]
    return split


def main() -> None:
    p = parser(__doc__, repeats=1)
    p.add_argument("--saves", type=int, default=4, help="saves per job (default %(default)s)")
    p.add_argument("--worker", choices=(STOCK, ASYNC, SYNC), help=argparse.SUPPRESS)
    args = parse(p)
    if args.worker:
        worker(args.worker, args.size_gb, args.saves, Path(args.dir))
        return

    width = width_for(args.size_gb)
    variants = [STOCK, ASYNC, SYNC]
    report = Report(
        "FSDP2 under Lightning, 2 ranks: blocking per save and bytes per rank (issue 14)",
        f"Lightning, 2 CPU processes (gloo), fully_shard over the data-parallel mesh (dp=2), {LAYERS} x "
        f"Linear({width}, {width}) + Adam (about {args.size_gb} GB); {args.saves} saves per job, every 2nd step, "
        f"each waited for at the end of the next step; {args.repeats} job(s) per variant in turns; median [IQR] "
        "in seconds, rank 0",
    )
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with scratch(args.dir, "sharded") as root:
        for round_ in range(args.repeats):
            for variant in rotated(variants, round_):
                directory = root / f"{round_}-{variants.index(variant)}"
                directory.mkdir()
                results, _ = run_worker(
                    "benchmarks.bench_sharded",
                    [
                        *("--worker", variant, "--size-gb", str(args.size_gb), "--saves", str(args.saves)),
                        *("--dir", str(directory), "--threads", str(args.threads)),
                    ],
                    timeout=600 + 180 * args.saves * max(1.0, args.size_gb),
                )
                samples[variant] += [s for r in results if r["rank"] == 0 for s in r["samples"][1:]]
                samples[f"{variant} first"] = [
                    *samples.get(f"{variant} first", []),
                    *(r["samples"][0] for r in results if r["rank"] == 0),
                ]
                shutil.rmtree(directory, ignore_errors=True)

    def block(variant: str) -> Stats:
        return Stats.of(s["block"] for s in samples[variant])

    stock = block(STOCK).median
    rows, shares = [], {}
    for v in variants:
        splits = [{int(r): b for r, b in s["bytes"].items()} for s in samples[v] if "bytes" in s]
        totals = [sum(split.values()) for split in splits]
        shares[v] = [split[r] / total for split, total in zip(splits, totals, strict=True) for r in (0, 1)]
        rows.append(
            [
                v,
                Stats.of(s["block"] for s in samples[f"{v} first"]).fmt(),
                block(v).fmt(),
                Stats.of(s["wait"] for s in samples[v]).fmt(),
                Stats.of(s["commit"] for s in samples[v] if "commit" in s).fmt() if v != STOCK else block(v).fmt(),
                f"{ratio(stock, block(v).median):.1f}x",
                f"{Stats.of(totals).median / GB:.3f}",
                f"{min(shares[v]):.1%} - {max(shares[v]):.1%}",
            ]
        )
    report.table(
        [
            "variant",
            "first save",
            "blocking per save",
            "of which staging wait",
            "time to commit",
            "Lightning's / it",
            "GB per checkpoint",
            "rank shares (min - max)",
        ],
        rows,
    )
    less = ratio(stock, block(ASYNC).median)
    balanced = all(abs(s - 0.5) <= SHARE_TOLERANCE * 0.5 for s in shares[ASYNC])
    report.add(
        f"- Target: at least {TARGET:.0f}x less blocking per save than ModelParallelStrategy's own save, ours with "
        f"async staging: {less:.1f}x, {verdict(less >= TARGET)}."
    )
    report.add(
        f"- Target: each rank writes within 10% of half the bytes (45%-55%), every checkpoint: {verdict(balanced)}."
    )
    report.add(
        "- Lightning's save blocks for the whole DCP write (fsync included, every rank) plus its copy of the "
        "state to CPU; ours blocks for the save call (state dicts, the agreement, handing over to the writer) "
        "and, with sync staging, the copy into reused host buffers. Its time to commit runs from the call to the "
        "local manifest, in the background."
    )
    report.print()


if __name__ == "__main__":
    main()
