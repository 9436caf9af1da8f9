"""The Hugging Face Trainer through ``attach_trainer``, in this process: its saves are the engine's (committed,
rotated by ``save_total_limit``), and every way of resuming ends with the weights of one uninterrupted run, or
is refused with the fix. The tiny GPT-2 of ``examples/transformers_trainer.py`` (dropout on: the RNG streams
must come back), 48 samples: 6 steps an epoch, so the runs cross epoch boundaries. Nothing is downloaded.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from accelerate_resilience import ResiliencePlugin
from accelerate_resilience.transformers import attach_trainer
from examples.transformers_trainer import make_trainer, weights_digest
from resilience.checkpoint.manager import CheckpointManager
from resilience.config import CheckpointConfig
from resilience.errors import ConfigError

STEPS, EVERY, SAMPLES = 14, 3, 48  # saves at 3, 6, 9, 12 and the last step, 14 (the Trainer saves at its end)


def trainer_in(output_dir: Path, **settings: Any) -> Any:
    """The example's Trainer with the pack attached (threads, no health monitor: this is the test process)."""
    trainer = make_trainer(str(output_dir), STEPS, EVERY, samples=SAMPLES, **settings)
    attach_trainer(trainer, ResiliencePlugin(persist="thread"))
    return trainer


def committed(output_dir: Path) -> list[int]:
    root = output_dir / "resilience"
    return sorted(int(p.parent.name.removeprefix("step-")) for p in root.glob("step-*/manifest.json"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted run, with its checkpoints, and the digest of its final weights."""
    out = tmp_path_factory.mktemp("reference") / "out"
    trainer = trainer_in(out)
    trainer.train()
    return out, weights_digest(trainer.model)


@pytest.fixture
def run(reference: tuple[Path, str], tmp_path: Path) -> Path:
    """A copy of the reference run's output directory, for a test to resume from (and change)."""
    out = tmp_path / "out"
    shutil.copytree(reference[0], out)
    return out


def test_saves_are_committed_by_the_engine_and_rotated_by_save_total_limit(reference: tuple[Path, str]) -> None:
    out, _ = reference
    assert committed(out) == [9, 12, 14], "save_total_limit=3 keeps the three newest"
    names = json.loads((out / "resilience" / "names.json").read_text())["names"]
    made = sorted(Path(name["path"]).name for name in names)
    assert made == sorted(p.name for p in out.glob("checkpoint-*")), "each folder is the pack's, not the Trainer's save"


def test_without_save_total_limit_every_checkpoint_is_kept_as_the_trainer_keeps_its_folders(tmp_path: Path) -> None:
    trainer = trainer_in(tmp_path / "out", save_total_limit=None)
    trainer.train()
    assert committed(tmp_path / "out") == [3, 6, 9, 12, 14]


def test_resume_true_from_the_newest_that_verifies_ends_with_the_uninterrupted_weights(
    run: Path, reference: tuple[Path, str]
) -> None:
    """Step 14's shard is damaged: the resume sets it aside, loads 12 and trains 13 and 14 exactly as before."""
    shard = next((run / "resilience" / "step-14").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    trainer = trainer_in(run)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == STEPS
    assert weights_digest(trainer.model) == reference[1]
    assert list((run / "resilience" / "quarantine").glob("step-14-*")), "the damaged copy is set aside, not loaded"


@pytest.mark.parametrize("path", ["resilience/step-9", "checkpoint-12"])
def test_resume_from_a_named_step_ends_with_the_uninterrupted_weights(
    run: Path, reference: tuple[Path, str], path: str
) -> None:
    """A step of the pack's named by its folder, or by the checkpoint-N folder made from it: step 9 is in epoch 1
    (6 steps an epoch), 12 at an epoch's end; both resume with the batches, RNG and schedule."""
    trainer = trainer_in(run)
    trainer.train(resume_from_checkpoint=str(run / path))
    assert weights_digest(trainer.model) == reference[1]
    assert trainer.state.global_step == STEPS
    assert trainer.state.log_history[0]["step"] == 10, "the resumed run's log goes on from the checkpoint's"


def test_a_run_at_max_steps_resumes_with_nothing_left_to_train(run: Path, reference: tuple[Path, str]) -> None:
    trainer = trainer_in(run)
    output = trainer.train(resume_from_checkpoint=True)
    assert output.global_step == trainer.state.global_step == STEPS
    assert weights_digest(trainer.model) == reference[1]
    assert committed(run) == [9, 12, 14], "no step past max_steps was trained or saved"


def test_nothing_to_resume_starts_at_step_0(tmp_path: Path, reference: tuple[Path, str]) -> None:
    trainer = trainer_in(tmp_path / "out")
    trainer.train(resume_from_checkpoint=True)
    assert weights_digest(trainer.model) == reference[1]


def test_a_fresh_start_sets_the_earlier_run_aside(run: Path, reference: tuple[Path, str]) -> None:
    """``train()`` without resuming, where a run left checkpoints: they are moved, never mixed with the new run's."""
    trainer = trainer_in(run)
    trainer.train()
    assert weights_digest(trainer.model) == reference[1]
    assert committed(run) == [9, 12, 14]
    assert len(list((run / "resilience" / "superseded").glob("run-*/step-*"))) == 3


def test_the_best_checkpoint_outlives_rotation_and_is_loaded_at_the_end(tmp_path: Path) -> None:
    """``greater_is_better`` on the eval loss makes the first evaluation the best: rotation keeps it beside the
    newest two, its folder beside the newest one (the Trainer's rotation of ``save_total_limit=2``), and
    ``load_best_model_at_end`` loads its verified weights."""
    out = tmp_path / "out"
    settings = {"eval_strategy": "steps", "eval_steps": EVERY, "load_best_model_at_end": True}
    settings |= {"metric_for_best_model": "loss", "greater_is_better": True, "save_total_limit": 2}
    trainer = trainer_in(out, eval_samples=16, **settings)
    trainer.train()
    assert trainer.state.best_global_step == EVERY
    assert trainer.state.best_model_checkpoint == str(out / f"checkpoint-{EVERY}")
    assert committed(out) == [EVERY, 12, 14]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-14", f"checkpoint-{EVERY}"]
    folder = load_file(out / f"checkpoint-{EVERY}" / "model.safetensors")
    manager = CheckpointManager(CheckpointConfig(local_root=str(out / "resilience"), persist="thread"))
    try:
        best = manager.load(step=EVERY, rank_state=False)
    finally:
        manager.close()
    assert best is not None
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, best.state["model"][name]), name
        assert name not in folder or torch.equal(tensor, folder[name]), name  # lm_head.weight is tied, not saved


@pytest.mark.parametrize("setting", ["save_only_model", "push_to_hub"])
def test_settings_the_pack_cannot_keep_are_refused_with_the_fix(tmp_path: Path, setting: str) -> None:
    trainer = make_trainer(str(tmp_path), STEPS, EVERY, samples=SAMPLES)
    setattr(trainer.args, setting, True)  # push_to_hub in the arguments would create a repository on the Hub
    with pytest.raises(ConfigError, match=f"{setting}=True.* leave {setting} off"):
        attach_trainer(trainer, ResiliencePlugin(persist="thread"))


def test_close_gives_the_trainer_its_own_checkpoints_back(tmp_path: Path) -> None:
    trainer = trainer_in(tmp_path, max_steps=EVERY)
    handle = trainer.callback_handler.callbacks[-1].handle
    handle.close()
    trainer.train()
    assert (tmp_path / f"checkpoint-{EVERY}" / "trainer_state.json").is_file()
    assert not (tmp_path / "resilience").exists()
