"""ModelCheckpoint's own features on top of the plugin, in one process: top-k, save_last, names vs data."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.demo_model import DemoData, DemoModel
from lightning_resilience import ResilientCheckpointIO
from lightning_resilience.pointer import read_pointer


def fit(root: Path, checkpoint: ModelCheckpoint, max_steps: int = 12) -> tuple[pl.Trainer, ResilientCheckpointIO]:
    pl.seed_everything(7)
    io = ResilientCheckpointIO(str(root / "ckpt"), keep_last=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=[checkpoint],
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(DemoModel(), DemoData())
    return trainer, io


def committed(root: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in (root / "ckpt").glob("step-*") if (p / "manifest.json").exists()}


@pytest.mark.parametrize("save_last", [True, "link"])
def test_top_k_and_last_names_point_to_committed_data_that_retention_keeps(tmp_path: Path, save_last: object) -> None:
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "names", every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=save_last
    )
    trainer, io = fit(tmp_path, checkpoint)
    names = {p.name for p in (tmp_path / "names").iterdir()}
    assert len(names - {"last.ckpt"}) == 2 and "last.ckpt" in names  # top-k removed the others' names
    pointed = {read_pointer(tmp_path / "names" / name).step for name in names}  # type: ignore[union-attr]
    last = tmp_path / "names" / "last.ckpt"
    if save_last == "link":  # Lightning links last.ckpt to the newest name its top-k logic saved
        assert last.is_symlink() and last.resolve().name in names
    else:  # a copy at the final step: here only another name for step 12's data
        assert read_pointer(last).step == 12  # type: ignore[union-attr]
    # keep_last=2 keeps the 2 newest; every step a name still points to is kept too; nothing else is
    kept = committed(tmp_path)
    assert pointed <= kept and kept == pointed | set(sorted(kept)[-2:])
    assert len(kept) < 6, "steps no name points to and older than the newest two were deleted"
    best = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    state = io.load_checkpoint(best)
    assert state["global_step"] == read_pointer(best).step  # type: ignore[union-attr]
    assert set(state) >= {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"}


def test_a_second_name_for_the_same_step_saves_nothing_twice(tmp_path: Path) -> None:
    trainer, io = fit(tmp_path, ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=4), max_steps=8)
    before = json.loads((tmp_path / "ckpt" / "step-8" / "manifest.json").read_text())
    trainer.save_checkpoint(tmp_path / "manual.ckpt")  # same global step, another name
    io.teardown()
    after = json.loads((tmp_path / "ckpt" / "step-8" / "manifest.json").read_text())
    assert after == before and read_pointer(tmp_path / "manual.ckpt").step == 8  # type: ignore[union-attr]


def test_a_plain_lightning_checkpoint_still_loads(tmp_path: Path) -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    TorchCheckpointIO().save_checkpoint({"state_dict": {}, "global_step": 3}, tmp_path / "old.ckpt")
    io = ResilientCheckpointIO(str(tmp_path / "ckpt"))
    assert io.load_checkpoint(tmp_path / "old.ckpt")["global_step"] == 3
