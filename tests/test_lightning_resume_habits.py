"""A resumed Lightning run continues the run the user sees: the same logger version, ``ModelCheckpoint``'s
folder and best-k state, and one metrics file whose rows read as if the run had never stopped."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from examples.demo_model import DemoData, DemoModel, Points
from lightning_resilience import AutoResume, GoodputMonitor, PeriodicCheckpoint, ResilientCheckpointIO
from tests.helpers import ROOT, base_env


def fit(root: Path, max_steps: int) -> tuple[pl.Trainer, ModelCheckpoint, list[warnings.WarningMessage]]:
    pl.seed_everything(3)
    best = ModelCheckpoint(monitor="train_loss", save_top_k=2, every_n_train_steps=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[ResilientCheckpointIO(str(root / "ckpt"), keep_last=3, sync_names_below_mb=64)],
        callbacks=[AutoResume(), PeriodicCheckpoint(every_n_steps=4), GoodputMonitor(window_steps=5), best],
        logger=CSVLogger(root / "logs"),
        log_every_n_steps=1,
        max_steps=max_steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    return trainer, best, fit_recording_warnings(trainer)


def fit_recording_warnings(trainer: pl.Trainer) -> list[warnings.WarningMessage]:
    """Fit the demo model; every warning raised meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DemoModel(), DemoData())
    return caught


def rows(trainer: pl.Trainer) -> list[dict[str, str]]:
    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as stream:  # type: ignore[union-attr]
        return list(csv.DictReader(stream))


def lightning_rows(trainer: pl.Trainer) -> list[tuple[int, str]]:
    """(step, train_loss) of Lightning's own rows; the pack's own metrics are rows of their own."""
    return [(int(r["step"]), r["train_loss"]) for r in rows(trainer) if r.get("train_loss")]


def test_a_resumed_run_continues_the_logger_version_names_best_k_and_metric_rows(tmp_path: Path) -> None:
    straight, _, _ = fit(tmp_path / "straight", 14)

    first, first_best, _ = fit(tmp_path / "run", 10)  # ends past its last save (8): steps 9 and 10 are lost
    assert first.logger.version == 0  # type: ignore[union-attr]
    kept = dict(first_best.best_k_models)
    assert not (tmp_path / "run" / "ckpt" / "step-10").exists()  # the relaunch resumes from step 8

    resumed, resumed_best, caught = fit(tmp_path / "run", 14)
    assert resumed.global_step == 14
    assert resumed.logger.version == 0, "the resumed run logs into the saved run's version"  # type: ignore[union-attr]
    assert not (tmp_path / "run" / "logs" / "lightning_logs" / "version_1").exists()
    assert resumed_best.dirpath == first_best.dirpath
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "dirpath has changed" in m or "will be deleted" in m], messages
    # best-k was reloaded: the names of the first run that are still among the best are still there
    assert set(kept) & set(resumed_best.best_k_models), (kept, resumed_best.best_k_models)
    for path in resumed_best.best_k_models:
        assert Path(path).is_file(), f"{path} is named best but is missing"

    assert len(lightning_rows(straight)) == 14
    # the pack's rows: each save's step once, as an integer; the whole run's goodput, lost time and downtime
    all_rows = rows(resumed)
    assert "checkpoint/step" not in all_rows[0]
    assert [r["checkpoint/committed_step"] for r in all_rows if r.get("checkpoint/committed_step")] == ["4", "8", "12"]
    assert {"goodput/run_pct", "goodput/run_lost_s", "goodput/run_downtime_s"} <= set(all_rows[0])
    assert any(float(r.get("goodput/run_lost_s") or 0) > 0 for r in all_rows), "steps 9 and 10 were lost"
    assert lightning_rows(resumed) == lightning_rows(straight), "one CSV, as if the run had never stopped"


def test_a_resumed_run_keeps_a_version_the_user_chose(tmp_path: Path) -> None:
    fit(tmp_path, 8)
    pl.seed_everything(3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[ResilientCheckpointIO(str(tmp_path / "ckpt"))],
        callbacks=[AutoResume()],
        logger=CSVLogger(tmp_path / "logs", version="mine"),
        max_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    caught = fit_recording_warnings(trainer)
    assert trainer.global_step == 10 and trainer.logger.version == "mine"  # type: ignore[union-attr]
    assert any("logs this resumed run as 'mine', the saved run as 0" in str(w.message) for w in caught)


def test_a_save_after_fit_keeps_the_auto_interval_for_the_run_resumed_from_it(tmp_path: Path) -> None:
    """The plan made in the fit is still there after it, and a run resumed from a save made then goes on with it
    instead of warming up again (which would save 5 steps after the resume)."""

    def trainer(max_steps: int) -> tuple[pl.Trainer, PeriodicCheckpoint]:
        pl.seed_everything(3)
        # an hour between saves, at a few milliseconds a step: after the first save (step 5), no other in this test
        interval = PeriodicCheckpoint(every_n_steps="auto", min_interval_s=3600.0, max_interval_s=3600.0)
        made = pl.Trainer(
            accelerator="cpu",
            devices=1,
            plugins=[ResilientCheckpointIO(str(tmp_path / "ckpt"))],
            callbacks=[interval],
            enable_checkpointing=False,
            logger=False,
            max_steps=max_steps,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        return made, interval

    first, interval = trainer(8)
    first.fit(DemoModel(), DemoData())
    plan = interval.last_plan
    assert plan is not None and plan["interval_steps"] > 16, plan
    first.save_checkpoint(tmp_path / "after-fit.ckpt")

    resumed, _ = trainer(16)
    resumed.fit(DemoModel(), DemoData(), ckpt_path=tmp_path / "after-fit.ckpt")
    assert resumed.global_step == 16
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*"))
    assert saved == [5, 8], "the resumed run saved again at the end of a new warm-up"


_SCRIPT = """
import logging, sys
import lightning.pytorch as pl
from examples.demo_model import DemoData, DemoModel
from lightning_resilience import AutoResume, GoodputMonitor, PeriodicCheckpoint, ResilientCheckpointIO

root, max_steps, level = sys.argv[1], int(sys.argv[2]), sys.argv[3]
logging.getLogger("lightning.pytorch").setLevel(level)
trainer = pl.Trainer(
    accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
    plugins=[ResilientCheckpointIO(root + "/ckpt")], callbacks=[AutoResume(), PeriodicCheckpoint(every_n_steps=4)],
    default_root_dir=root,
)
trainer.fit(DemoModel(), DemoData())
print("global_step", trainer.global_step)
"""


@pytest.mark.parametrize("level", ["INFO", pytest.param("ERROR", marks=pytest.mark.slow)])
def test_the_packs_log_lines_follow_lightnings_logger(tmp_path: Path, level: str) -> None:
    """A resume that sets a corrupt checkpoint aside says so the way Lightning's own lines are said, and a user
    who quiets Lightning's logger quiets the pack's lines with it."""

    def run(max_steps: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(tmp_path), str(max_steps), level],
            env=base_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )

    run(8)
    shard = next((tmp_path / "ckpt" / "step-8").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = run(10)
    assert "global_step 10" in resumed.stdout
    assert list((tmp_path / "ckpt" / "quarantine").iterdir()), "the corrupt step was set aside"
    said = "quarantined corrupt step 8" in resumed.stderr
    assert said == (level == "INFO"), resumed.stderr


class SlowPoints(Points):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.01)
        return super().__getitem__(index)


class SlowData(DemoData):
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(SlowPoints(self.size), batch_size=self.batch_size)


def test_a_starving_lightning_loader_gets_a_diagnosis_from_its_settings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under Lightning the pack reads the training loader's settings itself: the warning names the cause (here no
    workers), not a monitor call a Lightning user cannot reach."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[ResilientCheckpointIO(str(tmp_path / "ckpt"), persist="thread")],
        callbacks=[GoodputMonitor(window_steps=5)],
        logger=False,
        max_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(DemoModel(), SlowData())
    starving = [r.getMessage() for r in caplog.records if "num_workers=0" in r.getMessage()]
    assert starving, [r.getMessage() for r in caplog.records if "wait" in r.getMessage()]
    assert not any("watch()" in r.getMessage() for r in caplog.records)


class ValidatedModel(DemoModel):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))


class ValidatedData(DemoData):
    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(Points(8), batch_size=4)


def test_validate_best_after_a_fit_with_one_model_checkpoint_does_not_warn_of_several(tmp_path: Path) -> None:
    """Lightning counts AutoResume among the ModelCheckpoints: with one of the user's, its "multiple" warning is
    noise; "best" still loads that ModelCheckpoint's best file."""
    best = ModelCheckpoint(monitor="train_loss", save_top_k=1, every_n_train_steps=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[ResilientCheckpointIO(str(tmp_path / "ckpt"), persist="thread")],
        callbacks=[best, AutoResume()],
        logger=False,
        max_steps=8,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    model, data = ValidatedModel(), ValidatedData()
    trainer.fit(model, data)
    with warnings.catch_warnings(record=True) as caught:  # the filters in force stay as they are
        trainer.validate(model, data, ckpt_path="best")
    assert not [w for w in caught if "multiple `ModelCheckpoint`" in str(w.message)], [str(w.message) for w in caught]
    assert trainer.ckpt_path == best.best_model_path and best.best_model_path
