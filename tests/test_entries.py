"""Every tensor of a step is a plain DCP entry of its own, which DCP's own readers load in a process with no
code of the pack: small tensors, odd dtypes and strides, through the helper process and threads, dealt out over
gloo and resharded; the records are the bytes ``torch.save`` writes."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import struct
import subprocess
import sys
import zipfile
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

from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint.safe_reads import MetadataUnpickler
from resilience.checkpoint.tree import flatten
from resilience.errors import IncompatibleStateError
from resilience.formats.export import read_committed, write_file_atomically
from resilience.persist import tensor_records
from resilience.persist.direct_io import _no_zip_crcs, aligned_storages
from resilience.recovery.survivors import missing_entries
from resilience.storage.tiers import LocalTier
from tests.helpers import WORKERS, check_ranks, run_ranks


def mixed_state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(10, 10, generator=gen)
    return {
        "model": {f"layer{i}.w": torch.randn(i % 7 + 1, 3, generator=gen) for i in range(120)},
        "big": torch.randn(300_000, generator=gen),  # 1.2 MB
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
def test_roundtrip_with_and_without_a_target_every_tensor_an_entry(tmp_path: Path, persist: str) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path, persist=persist)) as m:  # type: ignore[arg-type]
        m.save(1, mixed_state(1))
        m.save(2, mixed_state(2))  # the same structure: reused staging buffers, new values
        changed = mixed_state(3)
        changed["model"]["extra"] = torch.arange(5)  # another structure
        m.save(3, changed)
        m.wait()
        for step, want in ((2, mixed_state(2)), (3, changed)):
            restored = m.load(step=step)
            assert restored is not None
            assert_same(want, restored.state)
        target = like(mixed_state(0))
        restored = m.load(target, step=2)
        assert restored is not None
        assert_same(mixed_state(2), restored.state)
        assert restored.state["model"]["layer3.w"] is target["model"]["layer3.w"]
        assert restored.state["param"] is target["param"]
    step = tmp_path / "step-2"
    assert set(dcp_keys(step)) == set(flatten(mixed_state(2)).tensors)
    body = json.loads((step / "manifest.json").read_text())
    assert body["version"] == 1 and not (step / "packs.json").exists()


HELD_OUT_READER = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

step, out = sys.argv[1], sys.argv[2]
dcp_to_torch_save(step, out + "/converted.pt")
entries = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
target = {
    key: torch.empty(md.size, dtype=md.properties.dtype)
    for key, md in entries.items()
    if isinstance(md, TensorStorageMetadata)
}
dcp.load(target, checkpoint_id=step, no_dist=True)
torch.save(target, out + "/loaded.pt")
ours = sorted(name for name in sys.modules if name.split(".")[0].endswith("resilience"))
assert not ours, ours
"""


def read_held_out(step: Path, out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What DCP's converter and ``dcp.load`` give for ``step`` in a fresh interpreter that imports torch alone
    (``-I``: not even the working directory on its path)."""
    done = subprocess.run(
        [sys.executable, "-I", "-W", "ignore", "-c", HELD_OUT_READER, str(step), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    converted = torch.load(out / "converted.pt", weights_only=True)
    return converted, torch.load(out / "loaded.pt", weights_only=True)


def test_dcps_own_readers_read_every_tensor_of_a_step_with_no_pack_code(tmp_path: Path) -> None:
    """torch's ``dcp_to_torch_save`` and a ``dcp.load`` under the step's keys, in a process that never imported
    the pack, get every tensor, small ones, odd dtypes, strides and views included."""
    state = mixed_state(5)
    with CheckpointManager(CheckpointConfig(tmp_path / "ckpt")) as m:
        m.save(5, state)
    converted, loaded = read_held_out(tmp_path / "ckpt" / "step-5", tmp_path)
    want = flatten(state).tensors
    assert set(loaded) == set(want) and len(want) > 130
    for key, tensor in want.items():
        assert_same(tensor.detach(), loaded[key])
        assert_same(tensor.detach(), converted[key])


def test_a_large_tensors_bytes_start_on_a_block_of_its_file_and_small_entries_stay_packed(tmp_path: Path) -> None:
    """A tensor over a MiB gets an entry whose storage lies on a 4 KiB boundary of the shard, so the helper writes
    it past the page cache straight from its staging buffer; small entries follow each other without a gap. DCP's
    readers, which read each entry at its offset, read them all."""
    state = {
        "large": torch.randn(3 << 20),
        "mid": torch.randn(300_000),
        **{f"s{i}": torch.randn(i + 1) for i in range(9)},
    }
    with CheckpointManager(CheckpointConfig(tmp_path / "ckpt")) as m:
        m.save(1, state)
    step = tmp_path / "ckpt" / "step-1"
    metadata = MetadataUnpickler(io.BytesIO((step / ".metadata").read_bytes())).load()
    where = {index.fqn: info for index, info in metadata.storage_data.items()}
    for key in ("large", "mid"):
        info = where[key]
        raw = (step / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(raw)) as entry:
            at = next(i for i in entry.infolist() if i.filename.endswith("/data/0")).header_offset
        name_length, extra_length = struct.unpack("<HH", raw[at + 26 : at + 30])  # the record's local header
        data_at = info.offset + at + 30 + name_length + extra_length
        assert data_at % 4096 == 0, (key, data_at)
    small = sorted((info.offset, info.length) for key, info in where.items() if key.startswith("s"))
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(small)), small
    _, loaded = read_held_out(step, tmp_path)
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key


def record_kinds() -> list[torch.Tensor]:
    base = torch.randn(6, 8)
    return [
        torch.randn(5, 3),
        torch.randn(3, 5).t(),  # transposed: its own storage, not contiguous
        base[1:4, ::2].clone(),
        torch.randn(2, 3, 4).permute(2, 0, 1),
        torch.arange(10, dtype=torch.bfloat16),
        torch.randn(7).to(torch.float8_e4m3fn),
        torch.tensor(3.0),
        torch.tensor([True, False, True]),
        torch.randint(-100, 100, (9,), dtype=torch.int16),
        torch.randn(2, 2, dtype=torch.complex128),
        torch.empty(0, 4),  # no bytes: torch.save's own
        torch.randn(300_000),
    ]


@pytest.mark.parametrize("crcs", [False, True], ids=["no CRC-32s", "CRC-32s"])
def test_a_record_is_the_bytes_torch_save_writes(crcs: bool) -> None:
    """The head and tail the writer reuses give, around a tensor's bytes, what ``torch.save`` writes for it, for
    every kind of tensor, made once and reused with other values; with CRC-32s on, it is ``torch.save``'s own. A
    large tensor's is ``torch.save``'s with its storage on a 4 KiB boundary (torch's ``storage_alignment``)."""
    for tensor in record_kinds():
        for values in (tensor, tensor.clone() if tensor.numel() == 0 else torch.full_like(tensor, 1).to(tensor.dtype)):
            large = values.nbytes > tensor_records.SMALL_BYTES
            with contextlib.nullcontext() if crcs else _no_zip_crcs():  # torch computes them by default
                theirs, ours = io.BytesIO(), io.BytesIO()
                with aligned_storages() if large else contextlib.nullcontext():
                    torch.save(values, theirs)
                tensor_records.write(ours, values)
                reused = tensor_records._pair(values) is not None
            # the head and tail are reused for every small tensor with bytes, and only without CRC-32s
            assert reused == (not crcs and 0 < values.nbytes <= tensor_records.SMALL_BYTES), values.shape
            assert ours.getvalue() == theirs.getvalue(), (values.dtype, values.shape, values.stride())
            assert_same(values, torch.load(io.BytesIO(ours.getvalue()), weights_only=True))


def test_a_load_into_a_target_of_another_shape_is_a_user_error_that_keeps_the_checkpoint(tmp_path: Path) -> None:
    with CheckpointManager(CheckpointConfig(tmp_path)) as m:
        m.save(1, {"w": torch.zeros(4, 4), "big": torch.zeros(300_000)})
    wrong_small = {"w": torch.zeros(5, 4), "big": torch.zeros(300_000)}
    wrong_big = {"w": torch.zeros(4, 4), "big": torch.zeros(3)}
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
    # each tensor stored on its own, not as a view of a larger storage every reader of the file would then load
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in loaded["model"].values())


def test_an_entry_no_survivor_wrote_is_reported_missing() -> None:
    def tensor_md(size: int) -> TensorStorageMetadata:
        chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([size]))
        return TensorStorageMetadata(TensorProperties(dtype=torch.uint8), torch.Size([size]), [chunk])

    merged = Metadata(state_dict_metadata={"small": tensor_md(64), "big": tensor_md(8)})
    assert missing_entries(merged, ["small", "big"]) == []
    assert missing_entries(merged, ["small", "other", "big"]) == ["other"]


ENTRIES_WORKER = WORKERS / "entries_worker.py"


def test_small_tensors_written_by_two_ranks_load_on_one_and_into_dtensors_on_two(tmp_path: Path) -> None:
    saved = check_ranks(run_ranks(ENTRIES_WORKER, ["save", str(tmp_path)], 2, timeout=240))
    assert all("SAVED 2" in r.output and "REFUSED" in r.output and "differ" in r.output for r in saved)
    step = tmp_path / "step-1"
    metadata = MetadataUnpickler(io.BytesIO((step / ".metadata").read_bytes())).load()
    files = {info.relative_path for index, info in metadata.storage_data.items() if index.fqn.startswith("model/p")}
    writers = {name.split("_")[2] for name in files}
    assert writers == {"0", "1"}, "the small tensors are dealt out to both ranks"
    assert not (tmp_path / "step-2").exists()
    loaded = check_ranks(run_ranks(ENTRIES_WORKER, ["load", str(tmp_path)], 1, timeout=240))
    assert "LOADED 1" in loaded[0].output
    loaded = check_ranks(run_ranks(ENTRIES_WORKER, ["load", str(tmp_path)], 2, timeout=240))
    assert all("LOADED 2" in r.output for r in loaded)
