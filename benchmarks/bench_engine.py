"""How long a save stops a training loop, engine level: torch.save, DCP async_save, the floor, and ours.

One process holds the model (8 x Linear(w, w) + Adam, w from --size-gb; 1.6 GB gives w = 4096) and takes turns:
each turn saves with one variant, runs one real training step (forward, backward, optimizer step), then waits
until that save is complete, so the next turn starts on a quiet machine. Blocking = the save call plus, for
asynchronous staging, the wait that the engine's optimizer pre-step hook makes the next ``optimizer.step()`` do
(read from the engine's counters). Time to commit = from the save call until the checkpoint is complete on
disk. The floor copies every tensor into preallocated host buffers: no save that blocks can be faster.

    .venv/bin/python -m benchmarks.bench_engine [--size-gb 1.6] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.common import (
    GB,
    LAYERS,
    HostCopy,
    Report,
    Sample,
    Stepper,
    alternate,
    build,
    column,
    model_state,
    now,
    parse,
    parser,
    ratio,
    scratch,
    tensors_in,
    verdict,
    width_for,
)
from resilience import CheckpointConfig, CheckpointManager

State = Callable[[], dict[str, Any]]


class Variant:
    """One way of saving, as a training loop drives it."""

    done = 0.0  # when the last save was complete (``now()`` clock)

    def save(self, step: int) -> None:
        raise NotImplementedError

    def waited(self) -> float:
        """Seconds the training thread has waited for background staging so far (in ``optimizer.step()``)."""
        return 0.0

    def drain(self) -> float:
        """Wait until the last save is complete and clean up after it; returns when it was complete."""
        return self.done

    def close(self) -> None:
        """Release what the variant keeps between saves."""


class TorchSave(Variant):
    """``torch.save`` of the whole state to one file: the usual single-process baseline."""

    def __init__(self, state: State, directory: Path):
        self.state, self.directory = state, directory

    def save(self, step: int) -> None:
        self.path = self.directory / f"step-{step}.pt"
        torch.save(self.state(), self.path)
        self.done = now()

    def drain(self) -> float:
        self.path.unlink()
        return self.done


class DcpAsyncSave(Variant):
    """``torch.distributed.checkpoint.async_save`` with its defaults (a fresh staging copy each call, fsync)."""

    def __init__(self, state: State, directory: Path):
        self.state, self.directory = state, directory

    def save(self, step: int) -> None:
        self.path = self.directory / f"step-{step}"
        future = dcp.async_save(self.state(), checkpoint_id=str(self.path))
        assert isinstance(future, Future)  # with the default stager; an async stager answers an AsyncSaveResponse
        self.future = future
        future.add_done_callback(self._stamp)

    def _stamp(self, _: object) -> None:
        self.done = now()

    def drain(self) -> float:
        self.future.result()
        shutil.rmtree(self.path)
        return self.done


class Floor(Variant):
    """Copy into buffers allocated once, and nothing else: the least any blocking save must cost."""

    def __init__(self, state: State, directory: Path):
        self.state = state
        self.copy = HostCopy()

    def save(self, step: int) -> None:
        self.copy.copy(tensors_in(self.state()))
        self.done = now()


class Ours(Variant):
    """The engine: stage into reused host buffers, then write, checksum and commit in the background."""

    def __init__(self, state: State, directory: Path, *, async_staging: bool):
        self.state = state
        config = CheckpointConfig(local_root=directory / "ours", async_staging=async_staging, keep_last=2)
        self.manager = CheckpointManager(config, listeners=[self._stamp])

    def _stamp(self, event: dict[str, Any]) -> None:
        if event["event"] == "local_commit":
            self.done = now()

    def save(self, step: int) -> None:
        self.manager.save(step, self.state())

    def waited(self) -> float:
        return self.manager.stats.staging_wait_s

    def drain(self) -> float:
        self.manager.wait()
        return self.done

    def close(self) -> None:
        self.manager.close()


VARIANTS: dict[str, Callable[[State, Path], Variant]] = {
    "torch.save": TorchSave,
    "DCP async_save (defaults)": DcpAsyncSave,
    "floor: copy into preallocated buffers": Floor,
    "ours, sync staging": lambda state, directory: Ours(state, directory, async_staging=False),
    "ours, async staging": lambda state, directory: Ours(state, directory, async_staging=True),
}
FLOOR, SYNC, ASYNC = "floor: copy into preallocated buffers", "ours, sync staging", "ours, async staging"


def turn(variant: Variant, stepper: Stepper, step: int) -> Sample:
    """Save, train one step, wait for the save to complete; what each phase cost the training thread."""
    start = now()
    variant.save(step)
    saved, waited = now(), variant.waited()
    stepper.step()
    stepped, wait = now(), variant.waited() - waited
    committed = variant.drain()
    return {
        "save": saved - start,
        "wait": wait,
        "block": saved - start + wait,
        "step": stepped - saved,
        "commit": committed - start,
    }


def take_turns(variants: dict[str, Variant], stepper: Stepper, repeats: int) -> dict[str, list[Sample]]:
    """Every variant's turns in rotating order after a warm-up round; the variants are closed afterwards."""
    steps = itertools.count(1)

    def turns_of(variant: Variant) -> Callable[[], Sample]:
        return lambda: turn(variant, stepper, next(steps))

    try:
        return alternate({name: turns_of(variant) for name, variant in variants.items()}, repeats)
    finally:
        for variant in variants.values():
            variant.close()


def main() -> None:
    args = parse(parser(__doc__))
    width = width_for(args.size_gb)
    model, optimizer, size = build(LAYERS, width)
    stepper = Stepper(model, optimizer, width)
    stepper.step()
    report = Report(
        "Engine: blocking time per save (issue 2)",
        f"{LAYERS} x Linear({width}, {width}) + Adam = {size / GB:.2f} GB, one CPU process; "
        f"{args.repeats} rounds after a warm-up round, variants in rotating order; median [IQR] in seconds",
    )
    with scratch(args.dir, "engine") as root:
        variants = {name: make(lambda: model_state(model, optimizer), root) for name, make in VARIANTS.items()}
        samples = take_turns(variants, stepper, args.repeats)

    floor = column(samples[FLOOR], "block").median
    report.table(
        ["variant", "blocking (save + staging wait)", "staging wait", "x floor", "training step", "time to commit"],
        [
            [
                name,
                column(rows, "block").fmt(),
                column(rows, "wait").fmt(),
                f"{ratio(column(rows, 'block').median, floor):.2f}",
                column(rows, "step").fmt(),
                column(rows, "commit").fmt(),
            ]
            for name, rows in samples.items()
        ],
    )
    sync, asyn = (ratio(column(samples[name], "block").median, floor) for name in (SYNC, ASYNC))
    report.add(f"- Target: sync staging at most 1.5x the floor: {sync:.2f}x, {verdict(sync <= 1.5)}.")
    report.add(f"- Target: async staging at most 0.2x the floor: {asyn:.2f}x, {verdict(asyn <= 0.2)}.")
    report.add(
        "- torch.save returns with the file in the page cache (no fsync); DCP and ours fsync before they count "
        "as complete. The training step column shows how much a background copy or write slows the step it "
        "overlaps."
    )
    report.print()


if __name__ == "__main__":
    main()
