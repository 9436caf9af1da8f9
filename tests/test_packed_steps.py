"""Steps saved by earlier releases, whose small tensors were packed into a few flat DCP entries
(``__packs__/<i>``, with ``packs.json`` saying where each lies), still load exactly, and are refused when
damaged or hostile. tests/data/packed-step-7 is such a step, as that release wrote it."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager, CorruptCheckpointError
from resilience.checkpoint.packing import PackIndex
from resilience.checkpoint.safe_reads import MetadataUnpickler
from resilience.cli import main as cli
from resilience.storage import manifest as manifest_module
from resilience.storage.catalog import scan
from resilience.storage.layout import PACK_PREFIX
from resilience.storage.manifest import Manifest
from resilience.storage.tiers import LocalTier
from tests.helpers import WORKERS, check_ranks, edit_manifest, reseal, run_ranks
from tests.test_entries import assert_same, like

FIXTURE = Path(__file__).parent / "data" / "packed-step-7"


def packed_state() -> dict[str, Any]:
    """What the fixture's step holds (made from the same generator)."""
    gen = torch.Generator().manual_seed(0)
    model = {"a.weight": torch.randn(4, 3, generator=gen), "a.bias": torch.randn(4, generator=gen)}
    model["b.weight"] = torch.randn(100, generator=gen).to(torch.bfloat16)
    return {"model": model, "step": 7, "name": "fixture"}


def older_state() -> dict[str, Any]:
    return {"model": {k: torch.full_like(v, 5) for k, v in packed_state()["model"].items()}, "step": 5}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with step 5, saved by this release, and step 7, the packed step of an earlier one."""
    with CheckpointManager(CheckpointConfig(tmp_path / "ckpt")) as m:
        m.save(5, older_state())
    shutil.copytree(FIXTURE, tmp_path / "ckpt" / "step-7")
    return tmp_path / "ckpt"


def test_a_packed_step_loads_with_and_without_a_target(root: Path) -> None:
    assert json.loads((root / "step-7" / "manifest.json").read_text())["version"] == 2
    assert cli(["verify", str(root), "--step", "7"]) == 0
    with CheckpointManager(CheckpointConfig(root)) as m:
        restored = m.load()
        assert restored is not None and restored.step == 7
        assert_same(packed_state(), restored.state)
        assert all(  # tensors of their own, not views that keep a pack alive
            t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in restored.state["model"].values()
        )
        target = like(packed_state())
        restored = m.load(target)
        assert restored is not None
        assert_same(packed_state(), restored.state)
        assert restored.state["model"]["a.bias"] is target["model"]["a.bias"]


def test_a_packed_step_loads_into_dtensors_on_two_ranks(root: Path) -> None:
    loaded = check_ranks(run_ranks(WORKERS / "entries_worker.py", ["load-packed", str(root)], 2, timeout=240))
    assert all("LOADED 2" in r.output for r in loaded)


def pack_range(step_dir: Path) -> tuple[Path, int, int]:
    """The shard holding pack 0, and the byte range of its record in it."""
    metadata = MetadataUnpickler(io.BytesIO((step_dir / ".metadata").read_bytes())).load()
    info = next(i for index, i in metadata.storage_data.items() if index.fqn == f"{PACK_PREFIX}0")
    return step_dir / info.relative_path, info.offset, info.length


def assert_falls_back(root: Path, problem: str) -> None:
    with CheckpointManager(CheckpointConfig(root)) as m, pytest.warns(UserWarning, match=problem):
        restored = m.load()
    assert restored is not None and restored.step == 5
    assert_same(older_state(), restored.state)


def test_a_flipped_bit_in_a_pack_fails_verification_before_anything_is_read(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard, offset, length = pack_range(root / "step-7")
    data = bytearray(shard.read_bytes())
    data[offset + length // 2] ^= 0x01  # inside the pack's bytes
    shard.write_bytes(bytes(data))
    assert cli(["verify", str(root), "--step", "7"]) == 1
    assert shard.name in capsys.readouterr().out
    assert_falls_back(root, "Skipping step 7")
    assert [p.name.split("-")[1] for p in (root / "quarantine").iterdir()] == ["7"]


def test_a_damaged_packs_index_is_caught_by_its_checksum(root: Path) -> None:
    path = root / "step-7" / "packs.json"
    path.write_bytes(path.read_bytes().replace(b'"float32"', b'"float64"', 1))
    assert cli(["verify", str(root), "--step", "7", "--quick"]) == 1
    with CheckpointManager(CheckpointConfig(root, verify="size")) as m, pytest.warns(UserWarning, match="packs"):
        restored = m.load()
    assert restored is not None and restored.step == 5


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda b: b["slots"].update({"model/a.bias": [f"{PACK_PREFIX}0", 10**9, "float32", [1]]}), "slot"),
        (lambda b: b["slots"].update({"model/a.bias": [f"{PACK_PREFIX}0", 0, "float32", [10**6]]}), "past"),
        (lambda b: b["packs"].update({f"{PACK_PREFIX}0": b["packs"][f"{PACK_PREFIX}0"] + 64}), "DCP metadata"),
        (lambda b: b.update(packs=[]), "packs"),
    ],
    ids=["offset out of range", "slot past its pack", "pack size unlike DCP's", "not an object"],
)
def test_a_resealed_hostile_packs_index_is_refused_and_the_load_falls_back(root: Path, edit: Any, problem: str) -> None:
    step = root / "step-7"
    body = json.loads((step / "packs.json").read_text())
    edit(body)
    (step / "packs.json").write_text(json.dumps(body))
    reseal(step, "packs.json")
    assert cli(["verify", str(root), "--step", "7"]) == 0  # its checksum matches: only parsing finds it
    assert_falls_back(root, problem)


def test_a_packs_file_in_a_version_1_manifest_is_refused(root: Path) -> None:
    edit_manifest(root / "step-7", lambda body: body.update(version=1))
    entry = next(e for e in scan(LocalTier(root)) if e.step == 7)
    assert entry.manifest is None and "version 2 or up" in str(entry.problem)


def test_a_reader_of_version_1_refuses_a_packed_step_with_upgrade(monkeypatch: pytest.MonkeyPatch) -> None:
    data = (FIXTURE / "manifest.json").read_bytes()
    monkeypatch.setattr(manifest_module, "VERSION", 1)
    with pytest.raises(CorruptCheckpointError, match=r"version 2 is not supported.*reads 1\.\.1.*upgrade"):
        Manifest.from_json(data, where="test")


@pytest.mark.parametrize(
    "slot",
    [
        [f"{PACK_PREFIX}0", 64, "float32", [100]],  # ends past the pack
        [f"{PACK_PREFIX}0", 4, "float32", [1]],  # not aligned
        [f"{PACK_PREFIX}0", 0, "Tensor", [1]],  # not a dtype
        [f"{PACK_PREFIX}0", 0, "qint8", [1]],  # quantized
        [f"{PACK_PREFIX}9", 0, "float32", [1]],  # no such pack
        [f"{PACK_PREFIX}0", 0, "float32", [-1]],
        [f"{PACK_PREFIX}0", 0, "float32", [True]],
        [f"{PACK_PREFIX}0", 0, "float32", [1] * 65],
        [f"{PACK_PREFIX}0", 0.0, "float32", [1]],
    ],
)
def test_hostile_layouts_are_refused(slot: list[object]) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"packs\.json is invalid"):
        PackIndex.from_json({"packs": {f"{PACK_PREFIX}0": 128}, "slots": {"k": slot}}, where="x")
    with pytest.raises(CorruptCheckpointError, match=r"packs\.json is invalid"):
        PackIndex.from_json({"packs": {"../etc/passwd": 128}, "slots": {}}, where="x")
