"""``resilience export`` and ``resilience.formats.export.export`` with real files: a Lightning ``.ckpt`` equal to
the file the adapter's names hold (also where Lightning is not installed), ``torch.save`` state dicts that load into the
model and optimizer of an Accelerate run, sharded safetensors, bf16 and weights-only exports, memory bounded
while streaming a state several times larger than the bound, the CLI's exit codes, a durable source, and a plain
``dcp.load`` of a step folder."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors import safe_open
from safetensors.torch import load_file

from accelerate_resilience import ResiliencePlugin, attach
from examples.demo_model import DemoData, DemoModel
from lightning_resilience import AutoResume, ResilientCheckpointIO
from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint.tree import flatten
from resilience.cli import EXIT_ERROR, EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from resilience.cli import main as cli
from resilience.formats.export import METADATA_KEY, dcp_keys, export, read_committed, remove_stale_temporaries
from resilience.formats.torch_file import placeholder_pickling
from resilience.storage.layout import rank_prefix
from resilience.storage.tiers import LocalTier
from tests.helpers import ROOT, WORKERS, base_env
from tests.test_entries import read_held_out
from tests.workers.accelerate_train import Job, build_job, train

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"

# ---- runs to export from ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 steps of the demo model with a full name every 4 steps and a weights-only name at step 8, both made from
    engine steps: a callback of the pack (here ``AutoResume``, on a fresh root) tells the plugin its Trainer."""
    root = tmp_path_factory.mktemp("lightning")
    pl.seed_everything(7)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[ResilientCheckpointIO(str(root / "ckpt"), keep_last=3, sync_names_below_mb=0.0)],
        callbacks=[
            ModelCheckpoint(dirpath=root / "names", filename="full-{step}", every_n_train_steps=4, save_top_k=-1),
            ModelCheckpoint(
                dirpath=root / "names", filename="weights-{step}", every_n_train_steps=8, save_weights_only=True
            ),
            AutoResume(),
        ],
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(DemoModel(), DemoData())
    return root


@pytest.fixture
def accelerate_job(tmp_path: Path) -> Iterator[tuple[Job, Path]]:
    """5 optimizer steps of the Accelerate test job, saved with ``accelerator.save_state()`` at step 5."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
    )
    job = build_job(accelerator)
    with attach(accelerator, ResiliencePlugin(local_root=str(tmp_path / "ckpt"), goodput=False)) as resilience:
        train(job, resilience, resilience.resume(), stop_at=5)
    yield job, tmp_path / "ckpt"
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Equal trees: same keys and types, tensors equal bit for bit."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (path, set(got) ^ set(want))
        for key in want:
            assert_same(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}/{index}")
    else:
        assert got == want, path


# ---- Lightning .ckpt -------------------------------------------------------------------------------------------


def test_lightning_export_is_the_file_the_names_hold(lightning_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "step8.ckpt"
    done = export(str(lightning_run / "ckpt"), str(out), format="lightning", step=8)
    assert done.files == [str(out)] and done.tensor_bytes > 0
    exported = torch.load(out, weights_only=True)
    named = torch.load(lightning_run / "names" / "full-step=8.ckpt", weights_only=True)
    assert exported.pop(METADATA_KEY)["step"] == named.pop(METADATA_KEY)["step"] == 8
    assert_same(exported, named)  # model, optimizer, schedulers, loops with the loader position, callbacks
    assert zipfile.ZipFile(out).testzip() is None  # every record's CRC-32 matches its bytes
    model = DemoModel.load_from_checkpoint(out)
    assert torch.equal(model.net[0].weight, named["state_dict"]["net.0.weight"])


def test_a_weights_only_bf16_lightning_export(lightning_run: Path, tmp_path: Path) -> None:
    out, root = tmp_path / "w.ckpt", str(lightning_run / "ckpt")
    assert cli(["export", f"{root}/step-8", str(out), "--format", "lightning", "--weights-only"]) == EXIT_OK
    assert cli(["export", root, str(tmp_path / "bf16.ckpt"), "--format", "lightning", "--dtype", "bf16"]) == EXIT_OK
    weights_only = torch.load(out, weights_only=True)
    lightnings_own = torch.load(lightning_run / "names" / "weights-step=8.ckpt", weights_only=True)
    assert set(weights_only) == set(lightnings_own)  # the keys Lightning's save_weights_only=True keeps
    assert not {"optimizer_states", "lr_schedulers", "callbacks"} & set(weights_only)
    assert_same(weights_only["state_dict"], lightnings_own["state_dict"])
    bf16 = torch.load(tmp_path / "bf16.ckpt", weights_only=True)
    for name, tensor in lightnings_own["state_dict"].items():
        assert bf16["state_dict"][name].dtype == torch.bfloat16
        assert torch.equal(bf16["state_dict"][name], tensor.to(torch.bfloat16)), name
    assert bf16["optimizer_states"][0]["state"][0]["exp_avg"].dtype == torch.float32  # optimizer state as saved


def test_the_engine_exports_a_lightning_file_where_lightning_is_not_installed(
    lightning_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "no-lightning.ckpt"
    script = f"""
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "accelerate"):
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)")
sys.meta_path.insert(0, Absent())
from resilience.cli import main
code = main(["export", {str(lightning_run / "ckpt")!r}, {str(out)!r}, "--format", "lightning"])
assert not any(m.split(".")[0] in ("lightning", "accelerate") for m in sys.modules), "a framework was imported"
sys.exit(code)
"""
    ran = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=base_env(), capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    named = torch.load(lightning_run / "names" / "full-step=8.ckpt", weights_only=True)
    assert_same(torch.load(out, weights_only=True)["state_dict"], named["state_dict"])


# ---- torch.save and safetensors from an Accelerate run ---------------------------------------------------------


def test_torch_exports_load_into_the_model_and_optimizer(accelerate_job: tuple[Job, Path], tmp_path: Path) -> None:
    job, root = accelerate_job
    model = job.accelerator.unwrap_model(job.model)
    export(str(root), str(tmp_path / "weights.pt"), format="torch", weights_only=True)
    export(str(root), str(tmp_path / "full.pt"), format="torch")

    fresh = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    fresh.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))  # strict: exactly the model's keys
    assert_same(fresh.state_dict(), model.state_dict())

    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert full["step"] == 5 and set(full) == {"step", "model", "optimizers", "schedulers", METADATA_KEY}
    optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    optimizer.load_state_dict(full["optimizers"][0])
    assert_same(optimizer.state_dict(), job.optimizer.state_dict())
    assert full["schedulers"][0] == job.scheduler.state_dict()


def test_safetensors_export_single_sharded_and_bf16(accelerate_job: tuple[Job, Path], tmp_path: Path) -> None:
    job, root = accelerate_job
    want = job.accelerator.unwrap_model(job.model).state_dict()
    out = tmp_path / "hf"
    export(str(root), str(out), format="safetensors")
    assert sorted(p.name for p in out.iterdir()) == [SINGLE]
    assert_same(load_file(out / SINGLE), dict(want))
    with safe_open(str(out / SINGLE), "pt") as handle:
        assert handle.metadata()["format"] == "pt"  # what transformers checks before loading
        assert json.loads(handle.metadata()[METADATA_KEY])["step"] == 5

    with pytest.raises(ValueError, match="--overwrite"):
        export(str(root), str(out), format="safetensors")
    # 321 weights are 642 bytes in bf16: a 600-byte limit splits them in two, and the single file goes.
    done = export(str(root), str(out), format="safetensors", dtype=torch.bfloat16, max_shard_bytes=600, overwrite=True)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX], names
    index = json.loads((out / INDEX).read_text())
    assert index["metadata"]["total_size"] == done.tensor_bytes == sum(t.numel() * 2 for t in want.values())
    loaded: dict[str, torch.Tensor] = {}
    for name, file in index["weight_map"].items():
        loaded[name] = load_file(out / file)[name]
    assert set(loaded) == set(want)
    for name, tensor in want.items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], tensor.to(torch.bfloat16)), name


def test_tied_weights_stay_tied_in_torch_and_are_both_named_in_safetensors(tmp_path: Path) -> None:
    shared = torch.randn(6, 4)
    with CheckpointManager(CheckpointConfig(tmp_path / "ckpt")) as manager:
        manager.save(2, {"model": {"embed.weight": shared, "head.weight": shared, "head.bias": torch.zeros(6)}})
    export(str(tmp_path / "ckpt"), str(tmp_path / "tied.pt"), format="torch", weights="model", weights_only=True)
    back = torch.load(tmp_path / "tied.pt", weights_only=True)
    assert back["embed.weight"].untyped_storage().data_ptr() == back["head.weight"].untyped_storage().data_ptr()
    assert torch.equal(back["embed.weight"], shared)
    export(str(tmp_path / "ckpt"), str(tmp_path / "st"), format="safetensors", weights="model")
    loaded = load_file(tmp_path / "st" / "model.safetensors")
    assert torch.equal(loaded["embed.weight"], shared) and torch.equal(loaded["head.weight"], shared)
    whole = tmp_path / "whole.pt"
    export(str(tmp_path / "ckpt"), str(whole), format="torch")  # the engine's own tree, as saved
    assert torch.equal(torch.load(whole, weights_only=True)["state"]["model"]["head.bias"], torch.zeros(6))


# ---- streaming ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_step(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """512 MiB of weights, 64 tensors of 8 MiB, each filled with its index."""
    root = tmp_path_factory.mktemp("big") / "ckpt"
    state = {"model": {f"layer{i}.weight": torch.full((2048, 1024), float(i)) for i in range(64)}}
    with CheckpointManager(CheckpointConfig(root, fsync=False)) as manager:
        manager.save(1, state)
    return root, sum(t.nbytes for t in state["model"].values())


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_an_export_streams_a_state_four_times_larger_than_its_memory_growth(
    big_step: tuple[Path, int], tmp_path: Path, fmt: str
) -> None:
    """Exported with a 16 MiB read budget, the exporting process's peak resident set (the kernel's VmHWM) grows
    by less than a quarter of the state.

    glibc raises its mmap threshold after large blocks are freed, so later blocks come from a heap that is not
    given back: the process then grows by more than what it holds at once (about 180 MB for a 1 GiB state with
    a 32 MiB budget). A fixed threshold (MALLOC_MMAP_THRESHOLD_) measures what the exporter itself holds.
    """
    root, size = big_step
    out = tmp_path / ("big.pt" if fmt == "torch" else "big")
    ran = subprocess.run(
        [sys.executable, str(WORKERS / "export_memory.py"), str(root), str(out), fmt, str(16 << 20)],
        cwd=ROOT,
        env=base_env({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    growth = report["peak_bytes"] - report["baseline_bytes"]
    assert report["tensor_bytes"] == size
    print(f"{fmt}: peak grew by {growth / 2**20:.0f} MiB exporting {size / 2**20:.0f} MiB")
    assert growth < size / 4, f"peak grew by {growth / 2**20:.0f} MiB exporting {size / 2**20:.0f} MiB"
    if fmt == "torch":
        back = torch.load(out, mmap=True, weights_only=True)["state"]["model"]
    else:
        back = load_file(out / "model.safetensors")
    for i in (0, 31, 63):
        assert torch.equal(back[f"layer{i}.weight"], torch.full((2048, 1024), float(i)))


# ---- the command, and other sources ---------------------------------------------------------------------------


def test_export_command_exit_codes(accelerate_job: tuple[Job, Path], tmp_path: Path) -> None:
    _, root = accelerate_job
    out = str(tmp_path / "x.pt")
    assert cli(["export", str(root / "step-5"), out, "--format", "torch", "--weights-only"]) == EXIT_OK
    assert cli(["export", str(root), out, "--format", "torch"]) == EXIT_ERROR  # exists, no --overwrite
    assert cli(["export", str(root), str(tmp_path / "y.ckpt"), "--format", "lightning"]) == EXIT_ERROR
    assert cli(["export", str(root), str(tmp_path / "y.pt"), "--format", "torch", "--step", "7"]) == EXIT_NOT_FOUND
    assert cli(["export", str(root), str(tmp_path / "y.pt"), "--format", "torch", "--model", "3"]) == EXIT_ERROR
    with pytest.raises(SystemExit) as usage:
        cli(["export", str(root), str(tmp_path / "y.pt")])
    assert usage.value.code == EXIT_USAGE
    shard = next((root / "step-5").glob("__*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli(["export", str(root), str(tmp_path / "z.pt"), "--format", "torch"]) == EXIT_FAILED
    assert not (tmp_path / "z.pt").exists()  # verified first: nothing written from a corrupt step


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resilience.cli", *args], cwd=ROOT, env=base_env(), capture_output=True, text=True
    )


def test_a_safetensors_file_name_is_written_as_one_file_that_load_file_reads(tmp_path: Path) -> None:
    """``export ROOT model.safetensors --format safetensors`` made a directory of that name, which ``load_file``
    could not open: a name with the format's suffix is one file; the weights go to a directory only above
    ``--max-shard-size``, and the command says so."""
    weights = {"w": torch.arange(120.0).reshape(10, 12), "b": torch.ones(10), "step": torch.tensor(3)}
    with CheckpointManager(CheckpointConfig(tmp_path / "ckpt")) as manager:
        manager.save(3, {"model": weights})
    root, out = str(tmp_path / "ckpt"), tmp_path / "model.safetensors"
    done = run_cli("export", root, str(out), "--format", "safetensors", "--weights", "model")
    assert done.returncode == EXIT_OK, done.stderr
    assert out.is_file() and f"-> {out} " in done.stdout
    assert_same(load_file(out), weights)
    again = run_cli("export", root, str(out), "--format", "safetensors", "--weights", "model")
    assert again.returncode == EXIT_ERROR and "--overwrite" in again.stderr

    big = str(tmp_path / "big.safetensors")
    split = run_cli("export", root, big, "--format", "safetensors", "--weights", "model", "--max-shard-size", "300")
    assert split.returncode == EXIT_OK, split.stderr
    folder = tmp_path / "big"
    assert not (tmp_path / "big.safetensors").exists()
    assert f"in the directory {folder}" in split.stderr and "exceed --max-shard-size (300 bytes)" in split.stderr
    index = json.loads((folder / INDEX).read_text())
    loaded = {name: load_file(folder / file)[name] for name, file in index["weight_map"].items()}
    assert_same(loaded, weights)

    torch_out = tmp_path / "model.pt"
    done = run_cli("export", root, str(torch_out), "--format", "torch", "--weights", "model", "--weights-only")
    assert done.returncode == EXIT_OK and torch_out.is_file(), done.stderr
    assert_same(torch.load(torch_out, weights_only=True), weights)
    wrong = run_cli("export", root, str(tmp_path / "w.safetensors"), "--format", "torch", "--weights", "model")
    assert wrong.returncode == EXIT_ERROR and "--format safetensors" in wrong.stderr
    assert not (tmp_path / "w.safetensors").exists()


def test_lightning_format_needs_a_lightning_run(accelerate_job: tuple[Job, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not Lightning.*--format torch"):
        export(str(accelerate_job[1]), str(tmp_path / "a.ckpt"), format="lightning")


def test_export_from_a_durable_url(tmp_path: Path, s3: dict[str, Any]) -> None:
    weights = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}
    config = CheckpointConfig(tmp_path / "local", durable_url=s3["url"], storage_options=s3["options"])
    with CheckpointManager(config) as manager:
        manager.save(4, {"model": weights})
        assert manager.wait(durable=True)
    option = f"endpoint_url={s3['options']['endpoint_url']}"
    out = tmp_path / "from-s3.pt"
    args = ["export", s3["url"], str(out), "--format", "torch", "--weights", "model", "--weights-only"]
    assert cli([*args, "--storage-option", option]) == EXIT_OK
    assert_same(torch.load(out, weights_only=True), weights)


# ---- DCP users -------------------------------------------------------------------------------------------------


def assert_dcp_reads_every_tensor(root: Path, step: int, out: Path) -> None:
    """DCP's own converter and ``dcp.load``, in a process with no pack code, get every tensor the engine's own
    reader gets from the step, with the same values."""
    restored = read_committed(LocalTier(root), step)
    ours = flatten(restored.state).tensors | flatten(restored.rank_state or {}, prefix=rank_prefix(0)).tensors
    converted, loaded = read_held_out(root / f"step-{step}", out)
    assert set(loaded) == set(ours) and set(converted) == set(ours), set(ours) ^ set(loaded)
    for key, tensor in ours.items():
        assert torch.equal(loaded[key], tensor) and torch.equal(converted[key], tensor), key


def test_dcp_reads_every_tensor_of_a_lightning_step(lightning_run: Path, tmp_path: Path) -> None:
    assert_dcp_reads_every_tensor(lightning_run / "ckpt", 8, tmp_path)


def test_dcp_reads_every_tensor_of_an_accelerate_step(accelerate_job: tuple[Job, Path], tmp_path: Path) -> None:
    assert_dcp_reads_every_tensor(accelerate_job[1], 5, tmp_path)


def test_a_step_folder_loads_with_plain_dcp_under_the_engines_keys(tmp_path: Path) -> None:
    """Plain DCP reads every tensor of a step folder under the engine's keys, the small ones too."""
    saved = DemoModel().state_dict()
    config = CheckpointConfig(tmp_path / "ckpt")
    with CheckpointManager(config) as manager:
        manager.save(8, {"state_dict": saved})
    step = tmp_path / "ckpt" / "step-8"
    model = DemoModel()
    with pytest.raises(BaseException, match=r"Missing key in checkpoint state_dict: state_dict\.net\.0\.weight"):
        dcp.load({"state_dict": model.state_dict()}, checkpoint_id=step)  # DCP's "." join is not our "/" path
    target = model.state_dict()
    dcp.load(dcp_keys(target, "state_dict"), checkpoint_id=step)
    assert_same(dict(target), saved)


def test_only_the_temporary_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    name = tmp_path / "best.ckpt"
    dead, live, other = (
        tmp_path / f".best.ckpt.tmp-{gone.pid}-0123abcd",
        tmp_path / f".best.ckpt.tmp-{os.getpid()}-0123abcd",
        tmp_path / f".last.ckpt.tmp-{gone.pid}-0123abcd",
    )
    for path in (name, dead, live, other):
        path.write_bytes(b"x")
    assert remove_stale_temporaries(str(name)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (name, live, other))


def test_the_half_built_folders_of_dead_writers_are_removed(tmp_path: Path) -> None:
    """A folder name (a Trainer's checkpoint-N, Accelerate's checkpoint_<i>) is built in a temporary folder: a writer
    killed mid-folder leaves one, which the next start removes (it raised IsADirectoryError there before). The
    earlier folder a replacement set aside (``.old``) is a whole checkpoint, and stays."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    name = tmp_path / "checkpoint-6"
    dead, live, aside = (
        tmp_path / f".checkpoint-6.tmp-{gone.pid}-0123abcd",
        tmp_path / f".checkpoint-6.tmp-{os.getpid()}-0123abcd",
        tmp_path / f".checkpoint-6.tmp-{gone.pid}-4567abcd.old",
    )
    for path in (dead, live, aside):
        path.mkdir()
        (path / "optimizer.pt").write_bytes(b"x")
    assert remove_stale_temporaries(str(name)) == [str(dead)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, aside))


def test_export_progress_counts_every_tensor_byte(tmp_path: Path) -> None:
    """``--progress`` printed "0 B" for a whole export: tensors copied from the shard files as they are were not
    counted, and the first report came before anything was read. It ends at the size the export reports."""
    weights = {"w": torch.randn(512, 512), "b": torch.ones(10)}
    with CheckpointManager(CheckpointConfig(tmp_path / "ckpt")) as manager:
        manager.save(1, {"model": weights})
    for out, fmt in ((tmp_path / "model.pt", "torch"), (tmp_path / "model.safetensors", "safetensors")):
        done = run_cli("export", str(tmp_path / "ckpt"), str(out), "--format", fmt, "--weights", "model", "--progress")
        assert done.returncode == EXIT_OK, done.stderr
        lines = [line for line in done.stderr.splitlines() if "tensors read for" in line]
        assert lines and lines[-1].endswith(": 1.0 MiB") and not any(line.endswith(": 0 B") for line in lines), lines
        assert "(torch, 1.0 MiB of tensors)" in done.stdout or "(safetensors, 1.0 MiB of tensors)" in done.stdout


def test_placeholders_pickle_as_the_cpu_tensors_they_stand_for() -> None:
    """A file written from placeholders (``meta`` tensors, no memory) must be ``torch.save``'s file of the real
    tensors: the same pickle, byte for byte, and the same records at the same sizes. Among them a tensor saved
    twice (one storage), a bfloat16, a uint16 (torch's newer rebuild function), a 0-d tensor and non-tensor
    values. Should torch change how it writes a CPU tensor, this fails before a name does."""
    weight = torch.randn(3, 4)
    real: dict[str, Any] = {
        "w": weight,
        "tied": weight,
        "h": torch.zeros(5, dtype=torch.bfloat16),
        "u": torch.zeros(6, dtype=torch.uint16),
        "step": torch.tensor(7),
        "nested": [torch.ones(1, 2, 3, dtype=torch.float64), {"lr": 0.1, "name": "adam"}],
    }
    meta: dict[int, torch.Tensor] = {}

    def placeholders_of(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return meta.setdefault(id(value), torch.empty(value.shape, dtype=value.dtype, device="meta"))
        if isinstance(value, dict):
            return {key: placeholders_of(item) for key, item in value.items()}
        return [placeholders_of(item) for item in value] if isinstance(value, list) else value

    stand_in = placeholders_of(real)
    placeholders = {id(p) for p in meta.values()}
    files = []
    for obj, module in ((real, pickle), (stand_in, placeholder_pickling(lambda v: id(v) in placeholders))):
        buffer = io.BytesIO()
        with torch.serialization.skip_data():
            torch.save(obj, buffer, pickle_module=module)
        files.append(zipfile.ZipFile(buffer))
    want, got = ({i.filename: i.file_size for i in f.infolist()} for f in files)
    assert got == want and "archive/data/0" in want and "archive/data/5" not in want  # 5 storages: w is tied
    assert files[1].read("archive/data.pkl") == files[0].read("archive/data.pkl")
    assert b"_rebuild_tensor_v3" in files[0].read("archive/data.pkl")  # the uint16 took the newer path
