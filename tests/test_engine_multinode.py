"""Several nodes: the engine tells them apart by the local root each rank writes to
(:func:`resilience.dist.node_identity`), so two agents on one host with roots of their own are two nodes, as two
machines would be; a durable load reads what a node's own disk still holds there.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.dist import Topology, node_identity
from resilience.storage import Tier
from tests.helpers import recording_open
from tests.workers.engine_worker import check_restored, state_for

# ---- single-process pieces (unit) ----------------------------------------------------------------------------


def test_node_identity_follows_the_local_root_directory_not_the_hostname(tmp_path: Path) -> None:
    """Ranks on one host with roots of their own are separate nodes; one directory under two paths is one."""
    a, b = tmp_path / "node-a", tmp_path / "node-b" / "deeper"
    (tmp_path / "alias").symlink_to(a, target_is_directory=True)
    ids = [node_identity(str(p)) for p in (a, b, tmp_path / "alias", a)]
    assert b.is_dir(), "the root is made, so it can be identified"
    assert ids[0] == ids[2] == ids[3] and ids[0] != ids[1]
    topology = Topology(rank=2, world_size=4, hosts=[ids[0], ids[0], ids[1], ids[1]])
    assert topology.ranks_on_my_host() == [2, 3] and not topology.single_host
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert node_identity(str(blocker / "root")) != ids[0]  # unusable: the set-up check then says why


def saved_in_both_tiers(tmp_path: Path) -> tuple[Path, str]:
    """Step 1 committed locally and durably by one process; the local root and the durable URL."""
    local, durable = tmp_path / "local", f"file://{tmp_path / 'durable'}"
    with CheckpointManager(CheckpointConfig(local, durable_url=durable)) as saver:
        saver.save(1, state_for(1, None), {"rank": torch.tensor([1])})
        saver.wait(durable=True)
    return local, durable


def load_recording_reads(
    local: Path, durable: str, monkeypatch: pytest.MonkeyPatch, **settings: Any
) -> list[tuple[str, str]]:
    """Load (the durable copy, as the local one is not loadable), check it bit-exact; the shard files opened."""
    reads: list[tuple[str, str]] = []
    with monkeypatch.context() as patch:
        patch.setattr(Tier, "open", recording_open(reads, Tier.open))
        with CheckpointManager(CheckpointConfig(local, durable_url=durable, **settings)) as loader:
            target = state_for(0, None)
            restored = loader.load(target)
    assert restored is not None and restored.tier == "durable"
    check_restored(restored, target, 1, 0, None)
    return reads


def test_a_durable_load_reads_the_shards_the_local_disk_holds_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's disk holds its files of a checkpoint the durable tier commits (here the local manifest is gone:
    no node-local one is loadable): the durable copy is loaded, with the shards read from the local disk where
    the bytes match, and from the durable tier where they do not (another attempt at the same step)."""
    local, durable = saved_in_both_tiers(tmp_path)
    (local / "step-1" / "manifest.json").unlink()
    assert load_recording_reads(local, durable, monkeypatch) == [("local", "__0_0.distcp")] * 2  # checked, read
    shard = local / "step-1" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert load_recording_reads(local, durable, monkeypatch) == [("local", "__0_0.distcp"), ("durable", "__0_0.distcp")]


def test_auto_verify_checks_durable_shards_by_size_and_full_downloads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify="auto" (the default) hashes shards only in the local tier: in the durable one that would download
    every shard twice. A fresh node (empty local disk) reads the durable shard once, or twice with "full"."""
    local, durable = saved_in_both_tiers(tmp_path)
    shutil.rmtree(local)
    assert load_recording_reads(local, durable, monkeypatch) == [("durable", "__0_0.distcp")]
    assert load_recording_reads(local, durable, monkeypatch, verify="full") == [("durable", "__0_0.distcp")] * 2
