"""Resharding through the engine with real models: DDP (replicated tensors) and FSDP2 (DTensor shards, on a
CPU device mesh with gloo), saved on 2 ranks and resumed on 1, and the other way round.

The worker compares the resumed model and optimizer state, gathered to full tensors, with the full state
written at save time: equal tensor for tensor, optimizer step counts and hyperparameters included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import WORKERS, check_ranks, run_ranks

WORKER = WORKERS / "reliability_reshard.py"


def run(mode: str, root: Path, world: int) -> list[str]:
    return [r.output for r in check_ranks(run_ranks(WORKER, [mode, str(root)], world, timeout=240))]


@pytest.mark.parametrize(("saved_on", "resumed_on"), [pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])
def test_ddp_and_fsdp2_resume_on_another_number_of_ranks(tmp_path: Path, saved_on: int, resumed_on: int) -> None:
    saved = run("save", tmp_path, saved_on)
    assert all(f"SAVED {kind} {saved_on}" in out for out in saved for kind in ("ddp", "fsdp2"))
    loaded = run("load", tmp_path, resumed_on)
    assert all(f"LOADED {kind} {saved_on} -> {resumed_on}" in out for out in loaded for kind in ("ddp", "fsdp2"))
