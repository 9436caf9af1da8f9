"""Damaged checkpoints: every kind is reported by ``resilience verify`` and skipped at resume.

Resume falls back to the previous good checkpoint with exactly its values, sets the damaged one aside, and
the step can be saved again. Damage to shard bytes that keeps sizes intact needs checksums of the shards
(``verify="full"``, or the ``resilience verify`` command); everything else is caught at the default level.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.cli import main as cli
from tests.helpers import edit_manifest
from tests.test_engine_local import make_state, manager


def shard(step_dir: Path) -> Path:
    return next(step_dir.glob("__*.distcp"))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def set_file_field(name: str, field: str, value: Callable[[Any], Any]) -> Callable[[Path], None]:
    def change(step_dir: Path) -> None:
        def edit(body: dict[str, Any]) -> None:
            entry = next(f for f in body["files"] if f["path"] == name or (name == "shard" and f["kind"] == "shard"))
            entry[field] = value(entry[field])

        edit_manifest(step_dir, edit)

    return change


CORRUPTIONS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "shard byte flipped": ("full", lambda d: flip_byte(shard(d))),
    "shard byte flipped, default level": ("auto", lambda d: flip_byte(shard(d))),
    "shard truncated": ("size", lambda d: truncate(shard(d))),
    "shard deleted": ("size", lambda d: shard(d).unlink()),
    "dcp metadata deleted": ("size", lambda d: (d / ".metadata").unlink()),
    "state.json byte flipped": ("size", lambda d: flip_byte(d / "state.json")),
    "manifest size tampered": ("size", set_file_field("shard", "size", lambda size: size + 1)),
    "manifest checksum tampered": ("size", set_file_field("state.json", "xxh3_64", lambda _: "0" * 16)),
    "manifest not json": ("size", lambda d: (d / "manifest.json").write_bytes(b"\x00\x01 not json {")),
    "manifest truncated": ("size", lambda d: truncate(d / "manifest.json")),
    "manifest of another step": (
        "size",
        lambda d: shutil.copy(d.parent / "step-1" / "manifest.json", d / "manifest.json"),
    ),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_damage_is_reported_and_resume_falls_back(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    verify, damage = CORRUPTIONS[kind]
    with manager(tmp_path, keep_last=3) as m:
        for step in (1, 2):
            m.save(step, make_state(step))
    damage(tmp_path / "step-2")

    assert cli(["verify", str(tmp_path)]) == 1
    report = capsys.readouterr().out
    assert "FAIL step 2" in report and "OK   step 1" in report, report

    with manager(tmp_path, keep_last=3, verify=verify) as m:
        with pytest.warns(UserWarning, match=r"Skipping step 2 in the local tier .*; trying step 1"):
            restored = m.load()
        assert restored is not None and restored.step == 1
        assert torch.equal(restored.state["model"]["w"], make_state(1)["model"]["w"])
        m.save(2, make_state(2))  # the damaged copy went to quarantine/, so the step can be saved again
    assert [p.name.split("-")[1] for p in (tmp_path / "quarantine").iterdir()] == ["2"]
    assert cli(["verify", str(tmp_path)]) == 0


def test_a_damaged_local_copy_falls_back_to_the_durable_copy_of_the_same_step(tmp_path: Path) -> None:
    config = CheckpointConfig(tmp_path / "local", durable_url=f"file://{tmp_path / 'remote'}", keep_last=3)
    with CheckpointManager(config) as m:
        for step in (1, 2):
            m.save(step, make_state(step))
            m.wait(durable=True)
    truncate(shard(tmp_path / "local" / "step-2"))
    assert json.loads((tmp_path / "remote" / "step-2" / "manifest.json").read_bytes())["step"] == 2
    with (
        CheckpointManager(config) as m,
        pytest.warns(UserWarning, match=r"Skipping step 2 in the local tier .*; trying step 2 in the durable"),
    ):
        restored = m.load()
    assert restored is not None and restored.step == 2 and restored.tier == "durable"
    assert torch.equal(restored.state["model"]["w"], make_state(2)["model"]["w"])
