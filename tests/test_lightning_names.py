"""Lightning's checkpoint contract on top of the plugin, in one process: every name Lightning reports is an
ordinary checkpoint file (``load_from_checkpoint``, ``torch.load``, a Trainer without the plugin), written only
after its step is committed; top-k and ``save_last`` work; a fresh run never aliases another run's steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemReader

from examples.demo_model import DemoData, DemoModel
from lightning_resilience import AutoResume, GoodputMonitor, ResilientCheckpointIO
from resilience.config import PersistSetting
from resilience.errors import ConfigError
from resilience.formats import crc
from resilience.formats.names import METADATA_KEY
from resilience.persist.direct_io import Window
from tests.helpers import ROOT, base_env


class BindsThePlugin(pl.Callback):
    """What the pack's callbacks do in their hooks: tell the plugin its Trainer, before any save or load (the
    plugin alone learns it from its strategy's first call: see
    :func:`test_the_plugin_alone_saves_in_the_background_and_its_teardown_waits`)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.on_save_checkpoint(trainer, pl_module, {})

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        io = trainer.strategy.checkpoint_io
        assert isinstance(io, ResilientCheckpointIO)
        io.bind(trainer)


def trainer_for(
    root: Path,
    *callbacks: pl.Callback,
    max_steps: int = 12,
    io: ResilientCheckpointIO | None = None,
    sync_below_mb: float = 0.0,
    bound: bool = True,
) -> pl.Trainer:
    """``sync_below_mb=0``: every name of a save inside the fit is written in the background, as a large
    state's would be, by a helper process as a large state's is."""
    pl.seed_everything(7)
    io = io or ResilientCheckpointIO(
        str(root / "ckpt"), keep_last=2, sync_names_below_mb=sync_below_mb, persist="process"
    )
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=[*callbacks, BindsThePlugin()] if bound else list(callbacks),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )


class Validated(DemoModel):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))


def test_the_names_crc32_is_the_zip_formats_with_or_without_zlib_ng() -> None:
    data = os.urandom(3 << 20)
    assert crc.crc32(data) == zlib.crc32(data) == crc.crc32(data[1000:], crc.crc32(data[:1000]))
    assert crc._crc32 is not zlib.crc32, "zlib-ng is in the lightning extra, so in the suite's environment"


def committed(root: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in (root / "ckpt").glob("step-*") if (p / "manifest.json").exists()}


def record_crcs(step_dir: Path) -> list[int]:
    """The CRC-32 of every storage record in the step's DCP entries (0 where the writer recorded none)."""
    crcs = []
    for info in FileSystemReader(str(step_dir)).read_metadata().storage_data.values():
        with open(step_dir / info.relative_path, "rb") as stream:
            stream.seek(info.offset)
            archive = zipfile.ZipFile(Window(stream, info.length))  # type: ignore[arg-type]
            crcs += [i.CRC for i in archive.infolist() if i.filename.rpartition("/")[0].endswith("/data")]
    return crcs


def assert_lightning_file(path: Path, step: int, *, full: bool = True) -> dict[str, object]:
    """A Lightning checkpoint as Lightning writes it, readable by torch.load without this pack."""
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["global_step"] == step and checkpoint[METADATA_KEY]["step"] == step
    keys = {"state_dict", "loops", "epoch", "global_step", "pytorch-lightning_version"}
    assert keys <= set(checkpoint)
    assert ({"optimizer_states", "lr_schedulers", "callbacks"} <= set(checkpoint)) == full
    return checkpoint


@pytest.mark.parametrize(
    ("save_last", "sync_below_mb"),
    [(True, 0.0), (True, 64.0), ("link", 0.0), ("link", 64.0)],
    ids=["True-background", "True-small-state-at-once", "link-background", "link-small-state-at-once"],
)
def test_top_k_and_last_names_are_lightning_files_that_load_anywhere(
    tmp_path: Path, save_last: object, sync_below_mb: float
) -> None:
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "names", every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=save_last
    )
    trainer = trainer_for(tmp_path, checkpoint, sync_below_mb=sync_below_mb)
    trainer.fit(DemoModel(), DemoData())
    names = {p.name for p in (tmp_path / "names").iterdir()}
    assert len(names - {"last.ckpt"}) == 2 and "last.ckpt" in names  # top-k removed the others' files
    last = tmp_path / "names" / "last.ckpt"
    if save_last == "link":  # Lightning links last.ckpt to the newest name its top-k logic saved
        assert last.is_symlink() and last.resolve().name in names
    else:
        assert_lightning_file(last, 12)
    best = Path(checkpoint.best_model_path)
    state = assert_lightning_file(best, int(best.stem.split("step=")[1]))
    assert zipfile.ZipFile(best).testzip() is None  # every record's CRC-32 is its bytes'
    for step in committed(tmp_path):
        # the name's writer computes them as it copies the bytes: torch's slower pass is skipped
        assert not any(record_crcs(tmp_path / "ckpt" / f"step-{step}")), step
    # the habits: load_from_checkpoint, and a Trainer without the plugin
    model = DemoModel.load_from_checkpoint(best)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state["state_dict"][key])  # type: ignore[index]
    plain = pl.Trainer(
        accelerator="cpu",
        max_steps=14,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / "plain",  # its own ModelCheckpoint's files: not in the working directory
    )
    plain.fit(DemoModel(), DemoData(), ckpt_path=best)  # resumed by stock Lightning: optimizer, loops and all
    assert plain.global_step == 14
    # keep_last=2 steps stay in the engine; the names are files of their own and need none of them
    assert len(committed(tmp_path)) == 2


def test_a_second_name_for_the_same_step_saves_nothing_twice(tmp_path: Path) -> None:
    trainer = trainer_for(tmp_path, ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=4), max_steps=8)
    trainer.fit(DemoModel(), DemoData())
    before = json.loads((tmp_path / "ckpt" / "step-8" / "manifest.json").read_text())
    trainer.save_checkpoint(tmp_path / "manual.ckpt")  # after fit: returns once the file is written
    after = json.loads((tmp_path / "ckpt" / "step-8" / "manifest.json").read_text())
    assert after == before
    assert_lightning_file(tmp_path / "manual.ckpt", 8)


@pytest.mark.parametrize("persist", ["process", "thread"])
def test_a_fit_leaves_no_thread_and_the_plugin_saves_again_in_the_next_fit(
    tmp_path: Path, persist: PersistSetting
) -> None:
    """Lightning's own test suite fails a test that leaves threads behind (its conftest checks), as a user's
    harness may: the engine rests after each fit (helper process and threads ended) and wakes at the next save."""
    import threading

    before = set(threading.enumerate())
    io = ResilientCheckpointIO(str(tmp_path / "ckpt"), keep_last=3, sync_names_below_mb=0.0, persist=persist)

    def names() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=4)

    trainer_for(tmp_path, names(), max_steps=4, io=io).fit(DemoModel(), DemoData())
    assert [t.name for t in set(threading.enumerate()) - before] == []
    again = trainer_for(tmp_path, names(), max_steps=8, io=io)
    again.fit(DemoModel(), DemoData(), ckpt_path=tmp_path / "names" / "epoch=0-step=4.ckpt")
    assert committed(tmp_path) == {4, 8}
    assert_lightning_file(tmp_path / "names" / "epoch=0-step=8.ckpt", 8)
    assert [t.name for t in set(threading.enumerate()) - before] == []


@pytest.mark.parametrize(("persist", "engine"), [("auto", "thread"), ("process", "process")])
def test_a_small_model_in_one_process_persists_in_threads_unless_told_otherwise(
    tmp_path: Path, persist: PersistSetting, engine: str
) -> None:
    """A helper process costs every run an interpreter importing torch, which the first commit waits for; a small
    model's saves have little work for it to take off the training thread."""
    io = ResilientCheckpointIO(str(tmp_path / "ckpt"), persist=persist)
    trainer_for(tmp_path, ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=2), max_steps=2, io=io).fit(
        DemoModel(), DemoData()
    )
    assert io._manager is not None and io._manager.config.persist == engine
    assert_lightning_file(tmp_path / "names" / "epoch=0-step=2.ckpt", 2)


def test_a_weights_only_name_never_stands_in_for_a_full_one(tmp_path: Path) -> None:
    weights = ModelCheckpoint(
        dirpath=tmp_path / "weights", filename="w-{step}", every_n_train_steps=4, save_weights_only=True
    )
    full = ModelCheckpoint(dirpath=tmp_path / "full", every_n_train_steps=8)  # step 8: both save
    trainer = trainer_for(tmp_path, weights, full, max_steps=8)
    trainer.fit(DemoModel(), DemoData())
    assert_lightning_file(tmp_path / "weights" / "w-step=8.ckpt", 8, full=False)
    assert_lightning_file(tmp_path / "full" / "epoch=0-step=8.ckpt", 8, full=True)
    resumed = trainer_for(tmp_path / "again", max_steps=12)  # another root: the file alone carries the state
    resumed.fit(DemoModel(), DemoData(), ckpt_path=tmp_path / "full" / "epoch=0-step=8.ckpt")
    assert resumed.global_step == 12


class GatedNames(ModelCheckpoint):
    """Records, right after each of its saves returns, whether the file and its committed step are there; only
    then may that step be written (``gated_write`` in tests/workers/helper_faults.py holds the write until then)."""

    def __init__(self, gates: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gates = gates
        self.found: list[tuple[bool, bool]] = []

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        manifest = Path(trainer.default_root_dir) / "ckpt" / f"step-{trainer.global_step}" / "manifest.json"
        self.found.append((os.path.isfile(filepath), manifest.exists()))
        (self.gates / f"open-{trainer.global_step}").touch()


def test_the_plugin_alone_saves_in_the_background_and_its_teardown_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """With Lightning's own strategy and no callback of the pack, as AsyncCheckpointIO is used: its strategy's calls
    bind the plugin to the Trainer, so a save inside the fit returns before its step is written, and the fit's
    teardown waits for the last one. After the fit a save is on disk when it returns, and a weights-only one is
    Lightning's own file, never a step that a resume would take for a full checkpoint."""
    gates = tmp_path / "gates"
    gates.mkdir()
    monkeypatch.setenv("RESILIENCE_HELPER_PRELOAD", "tests.workers.helper_faults")
    monkeypatch.setenv("TEST_HELPER_FAULT", "gated_write")
    monkeypatch.setenv("TEST_WRITE_GATE", str(gates))
    names = GatedNames(gates, dirpath=tmp_path / "names", every_n_train_steps=2, save_top_k=-1)
    trainer = trainer_for(tmp_path, names, max_steps=6, bound=False)  # names in the background
    trainer.fit(DemoModel(), DemoData())
    assert names.found == [(False, False)] * 3
    assert not [w for w in recwarn if "does not know its Trainer" in str(w.message)]
    for step in (2, 4, 6):
        assert_lightning_file(tmp_path / "names" / f"epoch=0-step={step}.ckpt", step)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert_lightning_file(tmp_path / "after.ckpt", 6)
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    weights = torch.load(tmp_path / "weights.ckpt", weights_only=True)
    assert "optimizer_states" not in weights and METADATA_KEY not in weights
    assert committed(tmp_path) == {4, 6}  # keep_last=2, and no step for the weights-only file


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "plugin-alone"])
def test_a_second_trainer_sharing_the_plugin_names_its_own_state_at_the_same_steps(tmp_path: Path, bound: bool) -> None:
    """The engine holds steps 4 and 8 of the first Trainer's model; the second reaches the same step numbers with
    another model, and its names hold that model, never the first's steps."""
    io = ResilientCheckpointIO(str(tmp_path / "ckpt"), keep_last=3, sync_names_below_mb=0.0, persist="thread")
    first = ModelCheckpoint(dirpath=tmp_path / "first", every_n_train_steps=4, save_top_k=-1)
    trainer_for(tmp_path, first, max_steps=8, io=io).fit(DemoModel(), DemoData())
    second = ModelCheckpoint(dirpath=tmp_path / "second", every_n_train_steps=4, save_top_k=-1)
    trainer = trainer_for(tmp_path, second, max_steps=8, io=io, bound=bound)
    model = DemoModel(hidden=16)
    trainer.fit(model, DemoData())
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    final = model.net[0].weight
    step_4 = torch.load(tmp_path / "second" / "epoch=0-step=4.ckpt", weights_only=True)["state_dict"]
    assert step_4["net.0.weight"].shape == final.shape
    for path in (tmp_path / "second" / "epoch=0-step=8.ckpt", tmp_path / "after.ckpt"):
        assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["net.0.weight"], final), path


def test_a_name_whose_step_retention_deleted_loads_as_the_file_it_is(tmp_path: Path) -> None:
    names = ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=4, save_top_k=-1)
    trainer_for(tmp_path, names, max_steps=12).fit(DemoModel(), DemoData())
    assert committed(tmp_path) == {8, 12}  # keep_last=2: step 4 is gone from the engine, its name is not
    resumed = trainer_for(tmp_path, max_steps=14)
    resumed.fit(DemoModel(), DemoData(), ckpt_path=tmp_path / "names" / "epoch=0-step=4.ckpt")
    assert resumed.global_step == 14


def test_save_then_validate_the_same_path_and_a_plain_checkpoint_loads(tmp_path: Path) -> None:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    trainer = trainer_for(tmp_path, max_steps=4)
    model = Validated()
    trainer.fit(model, DemoData())
    path = tmp_path / "mine.ckpt"
    trainer.save_checkpoint(path)
    assert trainer.validate(model, DemoData().train_dataloader(), ckpt_path=path, verbose=False)
    TorchCheckpointIO().save_checkpoint({"state_dict": {}, "global_step": 3}, tmp_path / "old.ckpt")
    io = ResilientCheckpointIO(str(tmp_path / "other"))
    assert io.load_checkpoint(tmp_path / "old.ckpt")["global_step"] == 3


def test_a_fresh_run_never_aliases_another_runs_steps(tmp_path: Path) -> None:
    """Re-running a script: the earlier run's checkpoints move aside (local tier only) and stay loadable."""
    names = ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=4)
    trainer_for(tmp_path, names, max_steps=8).fit(DemoModel(), DemoData())
    first = torch.load(tmp_path / "names" / "epoch=0-step=8.ckpt", weights_only=True)
    again = ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=4)
    trainer_for(tmp_path, again, max_steps=8).fit(DemoModel(hidden=16), DemoData())
    assert committed(tmp_path) == {4, 8}  # this run's own
    moved = sorted(p.name for p in (tmp_path / "ckpt" / "superseded").glob("run-*/step-*"))
    assert [name.split("-")[1] for name in moved] == ["4", "8"]  # the first run's, kept
    assert torch.equal(
        torch.load(tmp_path / "names" / "epoch=0-step=8.ckpt", weights_only=True)["state_dict"]["net.0.weight"],
        first["state_dict"]["net.0.weight"],
    )
    second = torch.load(tmp_path / "names" / "epoch=0-step=8-v1.ckpt", weights_only=True)  # Lightning versions it
    assert second["state_dict"]["net.0.weight"].shape == (16, 16), "the second run's name holds its own weights"


def test_a_fresh_run_on_another_runs_durable_checkpoints_is_refused_before_training(tmp_path: Path) -> None:
    def io() -> ResilientCheckpointIO:
        return ResilientCheckpointIO(str(tmp_path / "ckpt"), durable_url=f"file://{tmp_path}/durable", keep_last=2)

    names = ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=4)
    trainer_for(tmp_path, names, AutoResume(), max_steps=8, io=io()).fit(DemoModel(), DemoData())
    before = json.loads((tmp_path / "durable" / "step-8" / "manifest.json").read_text())
    shutil.rmtree(tmp_path / "ckpt")  # a new node, say: only the durable copy is left
    # with any of the pack's callbacks the run is refused when training starts ...
    second = trainer_for(tmp_path, GoodputMonitor(), max_steps=8, io=io())
    with pytest.raises(ConfigError, match=r"already holds checkpoints of another run.*would overwrite.*AutoResume"):
        second.fit(DemoModel(), DemoData())
    assert second.global_step == 0, "refused before the first step"
    # ... with the plugin alone, at its first save (Lightning tells a CheckpointIO nothing earlier)
    plugin_only = trainer_for(tmp_path, ModelCheckpoint(dirpath=tmp_path / "names2", every_n_train_steps=4), io=io())
    with pytest.raises(ConfigError, match="already holds checkpoints of another run"):
        plugin_only.fit(DemoModel(), DemoData())
    assert json.loads((tmp_path / "durable" / "step-8" / "manifest.json").read_text()) == before
    assert not list((tmp_path / "names2").glob("*.ckpt"))


def test_torch_save_of_a_trainer_with_the_pack(tmp_path: Path) -> None:
    trainer = trainer_for(tmp_path, AutoResume(), max_steps=2)
    trainer.fit(DemoModel(), DemoData())
    torch.save(trainer, tmp_path / "trainer.pt")  # what Lightning's own tests do
    again = torch.load(tmp_path / "trainer.pt", weights_only=False)
    assert isinstance(again.strategy.checkpoint_io, ResilientCheckpointIO)


SAVE_AND_EXIT = """
import sys
import lightning.pytorch as pl
from examples.demo_model import DemoData, DemoModel
from lightning_resilience import ResilientCheckpointIO
root = sys.argv[1]
pl.seed_everything(7)
io = ResilientCheckpointIO(root + "/ckpt", durable_url="file://" + root + "/durable")
trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[io],
                     max_steps=4, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, default_root_dir=root)
trainer.fit(DemoModel(), DemoData())
trainer.save_checkpoint(root + "/final.ckpt")
"""


def test_a_save_right_before_the_script_ends_is_committed_and_uploaded(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SAVE_AND_EXIT, str(tmp_path)], cwd=ROOT, env=base_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert_lightning_file(tmp_path / "final.ckpt", 4)
    assert (tmp_path / "ckpt" / "step-4" / "manifest.json").exists()
    assert (tmp_path / "durable" / "step-4" / "manifest.json").exists(), "the exit waited for the upload"
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_the_resume_marker_is_a_json_file_and_an_old_ckpt_marker_still_reads(tmp_path: Path) -> None:
    """AutoResume's pointer is no checkpoint, so it is not named like one (users tried torch.load on
    ``resume.ckpt``); a root written before keeps working."""
    from resilience.config import CheckpointConfig
    from resilience.formats.names import resolve, write_resume_marker

    path = write_resume_marker(tmp_path)
    assert os.path.basename(path) == "resume.json"
    assert json.loads(Path(path).read_text())["note"].startswith("not a checkpoint")
    old = tmp_path / "resume.ckpt"
    old.write_text(Path(path).read_text())
    config = CheckpointConfig(local_root=str(tmp_path))
    assert resolve(path, None, config) == (None, None)  # "the newest committed checkpoint that verifies"
    assert resolve(str(old), None, config) == (None, None)
