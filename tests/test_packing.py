"""Small plain tensors are saved packed into a few DCP entries and come back exactly: with and without a target,
through the helper process and threads, exported, resharded over gloo, and refused when damaged or hostile."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from resilience import CheckpointConfig, CheckpointManager, CorruptCheckpointError
from resilience import manifest as manifest_module
from resilience.catalog import scan
from resilience.cli import main as cli
from resilience.errors import IncompatibleStateError
from resilience.export import read_committed, write_file_atomically
from resilience.layout import PACK_PREFIX
from resilience.loader import MetadataUnpickler
from resilience.manifest import Manifest
from resilience.packing import ALIGN, PackLayout, plan
from resilience.storage import LocalTier
from resilience.survivors import missing_entries
from tests.helpers import WORKERS, check_ranks, edit_manifest, reseal, run_ranks


def mixed_state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(10, 10, generator=gen)
    return {
        "model": {f"layer{i}.w": torch.randn(i % 7 + 1, 3, generator=gen) for i in range(120)},
        "big": torch.randn(300_000, generator=gen),  # 1.2 MB: above pack_tensor_bytes, a DCP entry of its own
        "flags": torch.tensor([True, False, True]),
        "bf16": torch.randn(5, generator=gen).to(torch.bfloat16),
        "c64": torch.randn(3, dtype=torch.complex64, generator=gen),
        "c128": torch.randn(2, 2, dtype=torch.complex128, generator=gen),
        "f8": torch.randn(6, generator=gen).to(torch.float8_e4m3fn),
        "i16": torch.arange(9, dtype=torch.int16) - seed,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5 + seed),
        "transposed": torch.randn(4, 6, generator=gen).t(),
        "base": base,
        "view": base[2:5, 1::2],  # shares base's storage, non-contiguous
        "param": torch.nn.Parameter(torch.randn(7, generator=gen)),
        "optim": {"state": {0: {"exp_avg": torch.ones(2) * seed, "step": torch.tensor(float(seed))}}},
        "meta": {"seed": seed},
    }


def like(tree: Any) -> Any:
    """The same structure with other values (zeros), as a training script's live state before a load."""
    if isinstance(tree, dict):
        return {k: like(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return torch.zeros(tree.shape, dtype=tree.dtype)
    return tree


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == torch.float8_e4m3fn:  # no equality kernel for float8: compare the bytes
            a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        assert torch.equal(a, b)
    else:
        assert a == b


def dcp_keys(step_dir: Path) -> dict[str, Any]:
    metadata = MetadataUnpickler(io.BytesIO((step_dir / ".metadata").read_bytes())).load()
    return dict(metadata.state_dict_metadata)


@pytest.mark.parametrize("persist", ["process", "thread"])
def test_roundtrip_with_and_without_a_target(tmp_path: Path, persist: str) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path, persist=persist)) as m:  # type: ignore[arg-type]
        m.save(1, mixed_state(1))
        m.save(2, mixed_state(2))  # the same layout: reused staging views, new values
        changed = mixed_state(3)
        changed["model"]["extra"] = torch.arange(5)  # another layout
        m.save(3, changed)
        m.wait()
        for step, want in ((2, mixed_state(2)), (3, changed)):
            restored = m.load(step=step)
            assert restored is not None
            assert_same(want, restored.state)
            assert all(  # tensors of their own, not views that keep a pack alive
                t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in restored.state["model"].values()
            )
        target = like(mixed_state(0))
        restored = m.load(target, step=2)
        assert restored is not None
        assert_same(mixed_state(2), restored.state)
        assert restored.state["model"]["layer3.w"] is target["model"]["layer3.w"]
        assert restored.state["param"] is target["param"]
    step = tmp_path / "step-2"
    assert set(dcp_keys(step)) == {f"{PACK_PREFIX}0", "big"}
    body = json.loads((step / "manifest.json").read_text())
    assert body["version"] == 2 and [f["kind"] for f in body["files"] if f["path"] == "packs.json"] == ["packs"]


def test_packing_off_writes_version_1_and_either_setting_reads_both(tmp_path: Path) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path, pack_tensor_bytes=0, keep_last=5)) as m:
        m.save(1, mixed_state(1))
    step = tmp_path / "step-1"
    assert not (step / "packs.json").exists() and json.loads((step / "manifest.json").read_text())["version"] == 1
    assert "model/layer0.w" in dcp_keys(step)
    with CheckpointManager(CheckpointConfig(tmp_path, keep_last=5)) as m:  # packing on: reads the unpacked one
        restored = m.load()
        assert restored is not None
        assert_same(mixed_state(1), restored.state)
        m.save(2, mixed_state(2))
    with CheckpointManager(CheckpointConfig(tmp_path, pack_tensor_bytes=0, keep_last=5)) as m:
        restored = m.load()
        assert restored is not None and restored.step == 2
        assert_same(mixed_state(2), restored.state)


def test_a_reader_of_version_1_refuses_a_packed_checkpoint_with_upgrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path)) as m:
        m.save(1, mixed_state(1))
    data = (tmp_path / "step-1" / "manifest.json").read_bytes()
    monkeypatch.setattr(manifest_module, "VERSION", 1)
    with pytest.raises(CorruptCheckpointError, match=r"version 2 is not supported.*reads 1\.\.1.*upgrade"):
        Manifest.from_json(data, where="test")


def test_a_load_into_a_target_of_another_shape_is_a_user_error_that_keeps_the_checkpoint(tmp_path: Path) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path)) as m:
        m.save(1, {"w": torch.zeros(4, 4), "big": torch.zeros(300_000)})
    wrong_small = {"w": torch.zeros(5, 4), "big": torch.zeros(300_000)}  # a packed tensor
    wrong_big = {"w": torch.zeros(4, 4), "big": torch.zeros(3)}  # a DCP entry of its own
    for target in (wrong_small, wrong_big):
        with CheckpointManager(CheckpointConfig(tmp_path)) as m, pytest.raises(IncompatibleStateError, match="shape"):
            m.load(target)
    assert (tmp_path / "step-1" / "manifest.json").exists() and not (tmp_path / "quarantine").exists()


def test_export_writes_plain_tensors(tmp_path: Path) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path / "ckpt")) as m:
        m.save(4, mixed_state(4))
    restored = read_committed(LocalTier(tmp_path / "ckpt"), 4)
    write_file_atomically(restored.state, tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same(mixed_state(4), loaded)
    # each tensor stored on its own, not as a view into a pack that every reader of the file would then load
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in loaded["model"].values())


def pack_range(step_dir: Path) -> tuple[Path, int, int]:
    """The shard holding pack 0, and the byte range of its record in it."""
    metadata = MetadataUnpickler(io.BytesIO((step_dir / ".metadata").read_bytes())).load()
    info = next(i for index, i in metadata.storage_data.items() if index.fqn == f"{PACK_PREFIX}0")
    return step_dir / info.relative_path, info.offset, info.length


def saved_twice(root: Path) -> None:
    with CheckpointManager(CheckpointConfig(root)) as m:
        m.save(1, mixed_state(1))
        m.save(2, mixed_state(2))


def test_a_flipped_bit_in_a_pack_fails_verification_before_anything_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved_twice(tmp_path)
    shard, offset, length = pack_range(tmp_path / "step-2")
    data = bytearray(shard.read_bytes())
    data[offset + length // 2] ^= 0x01  # inside the pack's bytes
    shard.write_bytes(bytes(data))
    assert cli(["verify", str(tmp_path), "--step", "2"]) == 1
    assert shard.name in capsys.readouterr().out
    with CheckpointManager(CheckpointConfig(tmp_path)) as m, pytest.warns(UserWarning, match="Skipping step 2"):
        restored = m.load()
    assert restored is not None and restored.step == 1
    assert_same(mixed_state(1), restored.state)
    assert [p.name.split("-")[1] for p in (tmp_path / "quarantine").iterdir()] == ["2"]


def test_a_damaged_packs_index_is_caught_by_its_checksum(tmp_path: Path) -> None:
    saved_twice(tmp_path)
    path = tmp_path / "step-2" / "packs.json"
    path.write_bytes(path.read_bytes().replace(b'"float32"', b'"float64"', 1))
    assert cli(["verify", str(tmp_path), "--step", "2", "--quick"]) == 1
    with CheckpointManager(CheckpointConfig(tmp_path, verify="size")) as m, pytest.warns(UserWarning, match="packs"):
        restored = m.load()
    assert restored is not None and restored.step == 1


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda b: b["slots"].update({"model/layer0.w": [f"{PACK_PREFIX}0", 10**9, "float32", [1]]}), "slot"),
        (lambda b: b["slots"].update({"model/layer0.w": [f"{PACK_PREFIX}0", 0, "float32", [10**6]]}), "past"),
        (lambda b: b["packs"].update({f"{PACK_PREFIX}0": b["packs"][f"{PACK_PREFIX}0"] + 64}), "DCP metadata"),
        (lambda b: b.update(packs=[]), "packs"),
    ],
    ids=["offset out of range", "slot past its pack", "pack size unlike DCP's", "not an object"],
)
def test_a_resealed_hostile_packs_index_is_refused_and_the_load_falls_back(
    tmp_path: Path, edit: Any, problem: str
) -> None:
    saved_twice(tmp_path)
    step = tmp_path / "step-2"
    body = json.loads((step / "packs.json").read_text())
    edit(body)
    (step / "packs.json").write_text(json.dumps(body))
    reseal(step, "packs.json")
    assert cli(["verify", str(tmp_path), "--step", "2"]) == 0  # its checksum matches: only parsing finds it
    with CheckpointManager(CheckpointConfig(tmp_path)) as m, pytest.warns(UserWarning, match=problem):
        restored = m.load()
    assert restored is not None and restored.step == 1


def test_a_packs_file_in_a_version_1_manifest_is_refused(tmp_path: Path) -> None:
    saved_twice(tmp_path)
    edit_manifest(tmp_path / "step-2", lambda body: body.update(version=1))
    entry = next(e for e in scan(LocalTier(tmp_path)) if e.step == 2)
    assert entry.manifest is None and "version 2 or up" in str(entry.problem)


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
        PackLayout.from_json({"packs": {f"{PACK_PREFIX}0": 128}, "slots": {"k": slot}}, where="x")
    with pytest.raises(CorruptCheckpointError, match=r"packs\.json is invalid"):
        PackLayout.from_json({"packs": {"../etc/passwd": 128}, "slots": {}}, where="x")


def test_layout_is_deterministic_bounded_and_leaves_big_and_sharded_tensors_alone() -> None:
    tensors = {f"t{i}": torch.zeros(1000) for i in range(100)}  # 4000 bytes each
    tensors["big"] = torch.zeros(10_000)  # 40,000 bytes: not below the threshold
    a = plan(tensors, below_bytes=40_000, pack_bytes=100_000)
    b = plan(dict(tensors), below_bytes=40_000, pack_bytes=100_000)
    assert a == b and a.digest == b.digest and "big" not in a.slots
    assert len(a.sizes) == 5 and all(size <= 100_000 for size in a.sizes.values())
    assert all(slot.offset % ALIGN == 0 for slot in a.slots.values())
    assert PackLayout.from_json(json.loads(a.encoded), where="x") == a
    assert not plan(tensors, below_bytes=0, pack_bytes=100_000)
    units = a.units(tensors)
    assert list(units)[:2] == [f"{PACK_PREFIX}0", f"{PACK_PREFIX}1"] and units[f"{PACK_PREFIX}0"].is_meta
    changed = {**tensors, "t0": torch.zeros(999)}
    assert plan(changed, below_bytes=40_000, pack_bytes=100_000).digest != a.digest


def test_reserved_keys_are_refused(tmp_path: Path) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path)) as m, pytest.raises(ValueError, match="reserved"):
        m.save(1, {"__packs__": {"0": torch.zeros(2)}})


def test_a_pack_no_survivor_wrote_is_reported_missing() -> None:
    def tensor_md(size: int) -> TensorStorageMetadata:
        chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([size]))
        return TensorStorageMetadata(TensorProperties(dtype=torch.uint8), torch.Size([size]), [chunk])

    merged = Metadata(state_dict_metadata={f"{PACK_PREFIX}0": tensor_md(64), "big": tensor_md(8)})
    assert missing_entries(merged, [f"{PACK_PREFIX}0", "big"]) == []
    assert missing_entries(merged, [f"{PACK_PREFIX}0", f"{PACK_PREFIX}1", "big"]) == [f"{PACK_PREFIX}1"]


PACKING_WORKER = WORKERS / "packing_worker.py"


def test_packs_written_by_two_ranks_load_on_one_and_into_dtensors_on_two(tmp_path: Path) -> None:
    saved = check_ranks(run_ranks(PACKING_WORKER, ["save", str(tmp_path)], 2, timeout=240))
    assert all("SAVED 2" in r.output and "REFUSED" in r.output and "differ" in r.output for r in saved)
    step = tmp_path / "step-1"
    metadata = MetadataUnpickler(io.BytesIO((step / ".metadata").read_bytes())).load()
    files = {info.relative_path for index, info in metadata.storage_data.items() if PACK_PREFIX in index.fqn}
    writers = {name.split("_")[2] for name in files}
    assert writers == {"0", "1"}, "the packs are dealt out to both ranks"
    assert not (tmp_path / "step-2").exists()
    loaded = check_ranks(run_ranks(PACKING_WORKER, ["load", str(tmp_path)], 1, timeout=240))
    assert "LOADED 1" in loaded[0].output
    loaded = check_ranks(run_ranks(PACKING_WORKER, ["load", str(tmp_path)], 2, timeout=240))
    assert all("LOADED 2" in r.output for r in loaded)
