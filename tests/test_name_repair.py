"""A name a dead process left unwritten is written at the next start from its committed step; when that step went
meanwhile (a fresh run set it aside, retention deleted it), the name is forgotten, not a crash of rank 0.

Seen as a user reruns a script from scratch after deleting its ``.ckpt`` files: the record still lists them, the
repair queues them, and the fresh run's claim moves their steps to ``superseded/`` before they are written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.formats.names import REGISTRY, NameWriter


def test_a_repaired_name_whose_step_was_set_aside_is_forgotten(tmp_path: Path) -> None:
    root, name = tmp_path / "ckpt", tmp_path / "out" / "step=4.ckpt"
    with CheckpointManager(CheckpointConfig(local_root=root)) as manager:
        handle = manager.save(4, {"state_dict": {"w": torch.randn(8, 8)}}, extra={"adapter": "lightning"})
        NameWriter(manager.local).add(str(name), 4, ["state_dict"], handle, run_id=None).result()
        assert name.exists()
        name.unlink()  # the user deleted the file; the record still lists it
        (root / "superseded").mkdir()
        shutil.move(root / "step-4", root / "superseded" / "step-4-x")  # a fresh run set the step aside
        again = NameWriter(manager.local)  # the next start reads the record, and repairs what it lists
        again.repair({4})
        again.wait()  # raised NoCheckpointError, and rank 0 died with it
    assert not name.exists()
    recorded = json.loads((root / REGISTRY).read_text())["names"]
    assert [n for n in recorded if n["path"] == str(name)] == []
