"""Peer copies, in one process: a real server (its own process, as on a node) and real loads through it.

The two-node jobs that lose a node whole are in tests/test_engine_multinode.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.storage.manifest import FileEntry, Manifest
from resilience.storage.peer_copies import Address, ensure_server, held, partner, send_copy
from tests.helpers import record_tier_opens
from tests.workers.engine_worker import check_restored, state_for


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Address]:
    """A peer-copy server for a node whose local root is ``tmp_path/node-b``; killed after the test."""
    root = tmp_path / "node-b"
    address = ensure_server(str(root))
    assert address is not None
    pid = json.loads((root / ".peer" / "server.json").read_text())["pid"]
    try:
        assert ensure_server(str(root)) == address, "a running server is found again, not started twice"
        yield address
    finally:
        os.kill(pid, signal.SIGKILL)


def files_of(tmp_path: Path, names: dict[str, bytes]) -> tuple[Path, list[FileEntry]]:
    """Files written in a folder, with manifest entries whose checksums are the bytes'."""
    from resilience.storage.manifest import hash_bytes

    folder = tmp_path / "files"
    folder.mkdir(exist_ok=True)
    for name, data in names.items():
        (folder / name).write_bytes(data)
    return folder, [FileEntry(name, len(data), hash_bytes(data), 0, "shard") for name, data in names.items()]


def test_a_server_keeps_each_ranks_newest_copy_until_the_rank_stops_sending_and_answers_only_for_its_run(
    tmp_path: Path, server: Address
) -> None:
    """Each rank's newest copy replaces its older one; a rank that sent nothing in two rounds (newer steps
    arriving from others) has its copy dropped. A request that does not name the run gets nothing."""
    folder, files = files_of(tmp_path, {"a.distcp": b"a" * 100, "b.distcp": b"b" * 10})
    for rank, step in ((0, 1), (1, 1), (0, 2)):
        assert send_copy(server, rank=rank, run_id="run", step=step, directory=str(folder), files=files) == 110
    assert [(c["rank"], c["step"]) for c in held(server, "run")] == [(0, 2), (1, 1)]
    send_copy(server, rank=0, run_id="run", step=3, directory=str(folder), files=files[:1])
    assert [(c["rank"], c["step"], len(c["files"])) for c in held(server, "run")] == [(0, 3, 1)], (
        "rank 1 sent nothing since step 1, two rounds ago: it now sends elsewhere"
    )
    send_copy(server, rank=1, run_id="run", step=2, directory=str(folder), files=files)  # a resume from step 1
    assert [(c["rank"], c["step"]) for c in held(server, "run")] == [(0, 3), (1, 2)]
    assert held(server, "other-run") == []


def test_each_node_copies_to_the_next_node_that_has_a_server() -> None:
    nodes = ["a", "a", "b", "b", "c"]
    servers = {"a": ("h", 1), "b": ("h", 2), "c": ("h", 3)}
    assert partner(nodes, servers) == {"a": ("h", 2), "b": ("h", 3), "c": ("h", 1)}
    assert partner(nodes, {"a": ("h", 1), "c": ("h", 3)}) == {"a": ("h", 3), "b": ("h", 3), "c": ("h", 1)}
    assert partner(["a", "a"], {"a": ("h", 1)}) == {}, "never a node's own server"


def load_through(local: Path, durable: str, server: Address, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Load the durable step 1 with ``server`` as a peer, check it bit-exact; where each file was read."""
    reads: list[tuple[str, str]] = []
    with monkeypatch.context() as patch:
        record_tier_opens(reads, patch.setattr)
        with CheckpointManager(CheckpointConfig(local, durable_url=durable)) as loader:
            loader._restorer.peer_servers = [server]
            target = state_for(0, None)
            restored = loader.load(target)
    assert restored is not None and restored.tier == "durable"
    check_restored(restored, target, 1, 0, None)
    return reads


def saved_and_copied(tmp_path: Path, server: Address) -> tuple[Path, str, Manifest, Path]:
    """Step 1 committed locally and durably, its files sent to ``server``, and a copy of them to damage; the local
    root is then emptied, as on a replacement node."""
    local, durable = tmp_path / "node-a", f"file://{tmp_path / 'durable'}"
    with CheckpointManager(CheckpointConfig(local, durable_url=durable)) as saver:
        saver.save(1, state_for(1, None), {"rank": torch.tensor([1])})
        saver.wait(durable=True)
    manifest = Manifest.from_json((local / "step-1" / "manifest.json").read_bytes(), where="", expected_step=1)
    assert manifest.run_id is not None
    send_copy(server, rank=0, run_id=manifest.run_id, step=1, directory=str(local / "step-1"), files=manifest.files)
    damaged = tmp_path / "damaged"
    shutil.copytree(local / "step-1", damaged)
    shutil.rmtree(local)
    return local, durable, manifest, damaged


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_load_reads_a_peers_copy_and_passes_over_one_whose_bytes_are_not_the_manifests(
    tmp_path: Path, server: Address, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node with an empty disk reads the whole step from a peer's memory; when the peer holds a shard whose
    bytes differ from what it claims (the manifest's checksum), that shard is read from the durable tier."""
    local, durable, manifest, damaged = saved_and_copied(tmp_path, server)
    reads = load_through(local, durable, server, monkeypatch)
    assert reads and {tier for tier, _ in reads} == {"peer"}, reads

    flip_a_byte(damaged / "__0_0.distcp")
    assert manifest.run_id is not None
    send_copy(server, rank=0, run_id=manifest.run_id, step=1, directory=str(damaged), files=manifest.files)
    reads = load_through(local, durable, server, monkeypatch)
    assert [tier for tier, name in reads if name == "__0_0.distcp"] == ["durable"], reads
    assert {tier for tier, name in reads if name != "__0_0.distcp"} == {"peer"}, reads


def test_a_durable_shard_passed_over_for_a_peers_copy_is_checked_when_the_copy_fails(
    tmp_path: Path, server: Address
) -> None:
    """verify="full" hashes every durable shard before the load, except those a peer holds (read there, checked
    as they arrive). When the peer's bytes then fail their check, the durable shard read instead must be checked
    too: here it is damaged as well, so the step is skipped, never loaded with wrong values."""
    local, durable, manifest, damaged = saved_and_copied(tmp_path, server)
    flip_a_byte(damaged / "__0_0.distcp")
    assert manifest.run_id is not None
    send_copy(server, rank=0, run_id=manifest.run_id, step=1, directory=str(damaged), files=manifest.files)
    flip_a_byte(tmp_path / "durable" / "step-1" / "__0_0.distcp")
    with CheckpointManager(CheckpointConfig(local, durable_url=durable, verify="full")) as loader:
        loader._restorer.peer_servers = [server]
        with pytest.warns(UserWarning, match="__0_0.distcp has checksum"):
            assert loader.load(state_for(0, None)) is None
