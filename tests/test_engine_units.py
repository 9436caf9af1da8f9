"""Unit tests of the engine's pure parts: state trees, manifests, retention, settings and tiers."""

from __future__ import annotations

import io
import json
import math
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from resilience import CheckpointConfig, ConfigError, CorruptCheckpointError
from resilience.checkpoint import shm, staging
from resilience.checkpoint.tree import flatten, tensor_keys, unflatten
from resilience.config import auto_persist, persist_until_known
from resilience.storage.manifest import FileEntry, Manifest, check_relative_path, hash_bytes, hash_stream
from resilience.storage.retention import steps_to_delete
from resilience.storage.tiers import DurableTier, LocalTier, redact


class Opaque:
    def __init__(self, value: int):
        self.value = value


def roundtrip(tree: object, allow_pickle: bool = False) -> object:
    flat = flatten(tree)
    skeleton = json.loads(json.dumps(flat.skeleton, allow_nan=False))
    return unflatten(skeleton, flat.tensors, allow_pickle=allow_pickle, where="test")


def test_tree_keeps_key_types_tuples_and_special_values() -> None:
    optimizer = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    tree = {
        "optim": optimizer.state_dict(),
        "ints": {0: "a", 1: "b"},
        "tuple_key": {(1, 2): 3},
        "floats": [float("inf"), -float("inf"), 1.5],
        "nan": float("nan"),
        "np": np.random.get_state(),
        "py": random.getstate(),
        "misc": (torch.Size([2, 3]), torch.float16, torch.device("cpu"), b"\x00\x01", {3, 1}),
        "np_scalar": np.float32(2.5),
        "ordered": OrderedDict(a=1),
        "$t": "a key that looks like our tag",
    }
    out = roundtrip(tree)
    assert out["optim"]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert out["ints"] == {0: "a", 1: "b"} and out["tuple_key"] == {(1, 2): 3}
    assert out["floats"] == [math.inf, -math.inf, 1.5] and math.isnan(out["nan"])
    assert out["py"] == random.getstate()
    assert out["np"][0] == "MT19937" and np.array_equal(out["np"][1], np.random.get_state()[1])
    assert out["np"][1].dtype == np.uint32
    assert out["misc"] == (torch.Size([2, 3]), torch.float16, torch.device("cpu"), b"\x00\x01", {1, 3})
    assert isinstance(out["np_scalar"], np.float32) and out["np_scalar"] == np.float32(2.5)
    assert out["ordered"] == {"a": 1} and out["$t"] == "a key that looks like our tag"


def test_tree_tensor_keys_are_paths_and_tied_tensors_are_saved_once() -> None:
    weight = torch.randn(2, 2)
    flat = flatten({"model": {"enc.weight": weight, "dec.weight": weight}, "opt": {"state": {0: {"m": weight + 1}}}})
    assert list(flat.tensors) == ["model/enc.weight", "opt/state/0/m"]
    assert tensor_keys(flat.skeleton) == ["model/enc.weight", "model/enc.weight", "opt/state/0/m"]


def test_tree_pickles_only_with_consent() -> None:
    flat = flatten({"obj": Opaque(7)})
    assert flat.pickled == ["/obj"]
    with pytest.raises(ConfigError, match="allow_pickle=True"):
        unflatten(flat.skeleton, flat.tensors, allow_pickle=False, where="ckpt")
    assert unflatten(flat.skeleton, flat.tensors, allow_pickle=True, where="ckpt")["obj"].value == 7


def test_tree_rejects_ambiguous_keys() -> None:
    with pytest.raises(ValueError, match="map to the checkpoint key"):
        flatten({0: torch.zeros(1), "0": torch.ones(1)})


def good_manifest() -> Manifest:
    return Manifest(
        step=7,
        world_size=2,
        files=[
            FileEntry("__0_0.distcp", 10, "0123456789abcdef", 0, "shard"),
            FileEntry(".metadata", 5, "fedcba9876543210", 0, "dcp-metadata"),
        ],
    )


def test_manifest_roundtrip() -> None:
    manifest = good_manifest()
    back = Manifest.from_json(manifest.to_json(), where="m", expected_step=7)
    assert back.files == manifest.files and back.total_bytes == 15 and back.is_global


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda b: b.update(format="other"), "format"),
        (lambda b: b.update(version=99), "version"),
        (lambda b: b.update(step="7"), "'step'"),
        (lambda b: b.update(step=8), "does not match"),
        (lambda b: b.update(world_size=0), "'world_size'"),
        (lambda b: b["files"][0].update(path="../../etc/passwd"), "plain relative path"),
        (lambda b: b["files"][0].update(path="/abs"), "plain relative path"),
        (lambda b: b["files"][0].update(path="a/./b"), "plain relative path"),
        (lambda b: b["files"][0].update(size=1 << 60), "'size'"),
        (lambda b: b["files"][0].update(size=True), "'size'"),
        (lambda b: b["files"][0].update(rank=5), "'rank'"),
        (lambda b: b["files"][0].update(xxh3_64="zz"), "checksum"),
        (lambda b: b["files"][0].update(kind="exe"), "kind"),
        (lambda b: b.update(files=[]), "'files'"),
        (lambda b: b["files"].append(dict(b["files"][0])), "twice"),
        (lambda b: b.update(created_unix="now"), "created_unix"),
    ],
)
def test_manifest_rejects_hostile_or_broken_input(mutate, why) -> None:  # type: ignore[no-untyped-def]
    body = json.loads(good_manifest().to_json())
    mutate(body)
    with pytest.raises(CorruptCheckpointError, match=why):
        Manifest.from_json(json.dumps(body).encode(), where="m", expected_step=7)


def test_manifest_rejects_non_json_and_non_objects() -> None:
    with pytest.raises(CorruptCheckpointError, match="not JSON"):
        Manifest.from_json(b"\x80garbage", where="m")
    with pytest.raises(CorruptCheckpointError, match="not an object"):
        Manifest.from_json(b"[1, 2]", where="m")


@pytest.mark.parametrize("size", [0, 1, 3 << 20, (64 << 20) + 5])
def test_hash_stream_agrees_for_mapped_files_buffered_streams_and_copies(tmp_path, size) -> None:  # type: ignore[no-untyped-def]
    """Regular files are hashed through a memory map, window by window; other streams by reading. Both, and the
    copy made on the way, must give the bytes' own checksum, across a window edge too."""
    data = random.Random(size).randbytes(size)
    path = tmp_path / "shard"
    path.write_bytes(data)
    expected = (hash_bytes(data), size)
    with open(path, "rb") as stream:
        assert hash_stream(stream) == expected
        assert stream.tell() == size  # read to the end, as a reading hash leaves it
    with open(path, "rb") as stream, open(tmp_path / "copy", "w+b") as copy:
        assert hash_stream(stream, copy) == expected
    assert (tmp_path / "copy").read_bytes() == data
    assert hash_stream(io.BytesIO(data)) == expected
    with open(path, "rb") as stream:  # not at its start: only the rest is hashed
        stream.read(min(size, 1))
        assert hash_stream(stream) == (hash_bytes(data[1:]), max(size - 1, 0))


def test_relative_path_check() -> None:
    assert check_relative_path("a/b_c-1.distcp") == "a/b_c-1.distcp"
    for bad in ("..", "a/../b", "", "a\\b", "a//b", "x\x00"):
        with pytest.raises(ValueError):
            check_relative_path(bad)


def test_retention_keeps_newest_milestones_and_protected() -> None:
    committed = [10, 20, 30, 40, 50]
    assert steps_to_delete(committed, [], keep_last=2, keep_every=None) == [10, 20, 30]
    assert steps_to_delete(committed, [], keep_last=2, keep_every=20) == [10, 30]
    assert steps_to_delete(committed, [], keep_last=2, keep_every=None, protected=[20]) == [10, 30]
    # an uncommitted directory newer than the newest commit may be a save in flight
    assert steps_to_delete(committed, [45, 60], keep_last=3, keep_every=None) == [10, 20, 45]
    assert steps_to_delete([], [5], keep_last=2, keep_every=None) == []


def test_config_errors_name_the_fix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="keep_last >= 2"):
        CheckpointConfig(tmp_path, keep_last=1)
    with pytest.raises(ConfigError, match="when_busy"):
        CheckpointConfig(tmp_path, when_busy="queue")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="upload_concurrency"):
        CheckpointConfig(tmp_path, upload_concurrency=0)


def test_persist_auto_takes_threads_for_one_process_with_a_small_model_else_a_helper() -> None:
    small, large = torch.nn.Linear(64, 64), torch.nn.Linear(1024, 1024)  # 16 KiB; 4 MiB and its bias
    assert auto_persist([small], world_size=1) == "thread"
    assert auto_persist([small, large], world_size=1) == "process"
    assert auto_persist([small], world_size=2) == "process"  # a survivor must be able to end its helper
    assert auto_persist([], world_size=1) == "thread"
    assert [persist_until_known(p) for p in ("auto", "process", "thread")] == ["process", "process", "thread"]
    with pytest.raises(ConfigError, match="persist='helper' is not one of 'auto', 'process', 'thread'"):
        persist_until_known("helper")


def test_tier_errors_name_the_fix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="Unknown storage URL scheme"):
        DurableTier("nosuch://bucket/x")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"not writable.*point it at a directory"):
        LocalTier(blocker / "sub").check_writable()


@pytest.mark.parametrize(
    ("setting", "text", "meant"),
    [
        ("durable_url", "s3//bucket/run", "s3://bucket/run"),
        ("durable_url", "s3:/bucket/run", "s3://bucket/run"),
        ("durable_url", "gs:bucket/run", "gs://bucket/run"),
        ("local_root", "memory//x", "memory://x"),
    ],
)
def test_mistyped_urls_are_refused_not_taken_for_local_folders(setting: str, text: str, meant: str) -> None:
    make = LocalTier if setting == "local_root" else DurableTier
    with pytest.raises(ConfigError, match=rf"{setting}=.*mistyped URL.*did you mean '{meant}'"):
        make(text)


def test_the_local_tier_refuses_urls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """DCP writes the local tier with file I/O: a URL there would put shards in the host's /x/."""
    with pytest.raises(ConfigError, match=r"local_root='memory://x' is a URL.*durable_url"):
        LocalTier("memory://x")
    with pytest.raises(ConfigError, match="local_root is empty"):
        LocalTier("")
    assert LocalTier(tmp_path / "a" / ".." / "b").root == str(tmp_path / "b")


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_an_exclusive_write_refuses_a_file_that_exists(tmp_path, scheme: str) -> None:  # type: ignore[no-untyped-def]
    """A manifest appears once: the commit protocol's one exclusive write. file:// makes it with link();
    memory:// (like the object stores) with fsspec's pipe_file(mode="create"), which memory:// honours from
    fsspec 2024.12, the floor; before it the second write replaced the first."""
    url = (tmp_path / "durable").as_uri() if scheme == "file" else f"memory://exclusive/{tmp_path.name}"
    tier = DurableTier(url)
    path = f"{tier.root}/step-1/manifest.json"
    tier.write_exclusive(path, b"first")
    with pytest.raises(FileExistsError):
        tier.write_exclusive(path, b"second")
    assert tier.read_bytes(path) == b"first"


def test_redact_masks_credentials() -> None:
    shown = redact(
        {
            "key": "AKIA",
            "secret": "s",
            "endpoint_url": "http://x",
            "client_kwargs": {"aws_session_token": "t"},
        }
    )
    assert shown == {
        "key": "***",
        "secret": "***",
        "endpoint_url": "http://x",
        "client_kwargs": {"aws_session_token": "***"},
    }
    assert "AKIA" not in repr(DurableTier("memory://b/x", {"key": "AKIA"}))


def test_replicated_tensors_are_dealt_out_among_the_ranks_that_write() -> None:
    from resilience.checkpoint.deal import share_among

    sizes = [100, 60, 50, 40, 10]
    tensors = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    shares = [share_among(tensors, rank, [0, 1]) for rank in range(2)]
    assert sorted([*shares[0], *shares[1]]) == sorted(tensors), "every tensor is written by exactly one rank"
    assert not set(shares[0]) & set(shares[1])
    assert [sum(t.numel() for t in share.values()) for share in shares] == [140, 120]  # greedy: 100+40 / 60+50+10
    assert share_among(tensors, 0, [0]) == tensors
    # rank 1 abstains (a sick GPU) or is lost: ranks 0 and 2 write everything between them
    thirds = [share_among(tensors, rank, [0, 2]) for rank in range(3)]
    assert thirds[1] == {} and sorted([*thirds[0], *thirds[2]]) == sorted(tensors)


class RecordingCudart:
    """The CUDA runtime calls staging makes, recorded; this machine has no GPU. ``refuse``: registration fails."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", pointer))
        return 1 if self.refuse else 0  # 1: cudaErrorInvalidValue

    def cudaHostUnregister(self, pointer: int) -> int:
        self.calls.append(("unregister", pointer))
        return 0


def test_a_page_locked_shared_buffer_is_unregistered_before_its_memory_is_unmapped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Registered memory must be unregistered before it is unmapped (on an H200, buffers freed while registered
    made a later fit fail with "resource already mapped"); the registration holds the mapping until then."""
    cudart = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: cudart.calls.append(("synchronize", 0)))
    stager = staging.HostStager(pin_memory=True, shared=True)
    buffer = stager._buffer("w", (4, 1024), torch.float32, cuda=True)
    pointer = buffer.data_ptr()
    name = staging.SEGMENTS[pointer]
    assert cudart.calls == [("register", pointer)]
    assert staging.PINNED[pointer].data_ptr() == pointer  # the mapping stays while registered
    del buffer
    stager.close()
    assert cudart.calls[1:] == [("synchronize", 0), ("unregister", pointer)]  # no copy into it runs any more
    assert pointer not in staging.PINNED and pointer not in staging.SEGMENTS
    assert not (Path(shm.SHM_DIR) / name).exists()
    plain = staging.HostStager(pin_memory=True, shared=True)  # a CPU source's buffer is never page-locked
    plain._buffer("w", (16,), torch.float32, cuda=False)
    plain.close()
    assert len(cudart.calls) == 3


def test_a_refused_page_lock_names_the_fix_and_leaves_no_segment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: RecordingCudart(refuse=True))
    segments = lambda: set(Path(shm.SHM_DIR).glob(f"{shm.PREFIX}{shm._token()}_*"))  # noqa: E731
    before, known = segments(), dict(staging.SEGMENTS)
    with pytest.raises(RuntimeError, match="set pin_memory=False"):
        staging.HostStager(pin_memory=True, shared=True)._buffer("w", (1024,), torch.float32, cuda=True)
    assert known == staging.SEGMENTS
    assert segments() == before


def test_a_long_read_says_it_is_still_going(caplog: pytest.LogCaptureFixture) -> None:
    """A restore that reads for minutes said nothing until its end: a line every so often shows it is not stuck,
    and a short one says nothing."""
    import time

    from resilience.progress import still_going

    caplog.set_level("INFO", logger="resilience.progress")
    with still_going("reading step 8 from the durable tier (1.00 GiB)", every_s=0.05):
        time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records if r.name == "resilience.progress"]
    assert len(lines) >= 2 and all(
        line.startswith("reading step 8 from the durable tier (1.00 GiB): ") for line in lines
    )
    caplog.clear()
    with still_going("a short read", every_s=10):
        pass
    assert not [r for r in caplog.records if r.name == "resilience.progress"]
    with still_going("reading", every_s=0.05, detail=lambda: "0.50 GiB read here"):
        time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "resilience.progress"]
    assert lines and all(line.startswith("reading: 0.50 GiB read here, ") for line in lines), lines


def test_a_load_counts_the_bytes_it_reads(tmp_path: Path) -> None:
    """What the restore's progress line says it has read: every tensor byte of the step, from its shards."""
    from resilience import CheckpointConfig, CheckpointManager
    from resilience.checkpoint.loader import read_tensors
    from resilience.checkpoint.safe_reads import load_dcp_metadata
    from resilience.storage import catalog
    from resilience.storage.dcp_fs import ReadCounter
    from resilience.storage.tiers import LocalTier

    state = {"w": torch.randn(512, 512), "b": torch.randn(7)}
    with CheckpointManager(CheckpointConfig(tmp_path)) as manager:
        manager.save(1, state)
    (entry,) = [e for e in catalog.scan(LocalTier(tmp_path)) if e.committed]
    counter = ReadCounter()
    targets = {key: torch.empty_like(value) for key, value in state.items()}
    read_tensors(entry, load_dcp_metadata(entry), targets, read=counter)
    assert all(torch.equal(targets[key], value) for key, value in state.items())
    assert entry.manifest is not None
    # torch.load reads an entry's zip directory a second time: a few KiB per entry beyond the files' size
    assert sum(t.nbytes for t in state.values()) <= counter.bytes <= entry.manifest.total_bytes + 4096 * len(state)
