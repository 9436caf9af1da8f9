"""A full disk, for real: size- and inode-limited tmpfs mounts make the kernel answer ENOSPC.

Each case checks the same three things: the error reaches the training thread naming the cause and the
step, the failed step gets no manifest, and older checkpoints stay intact and loadable.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilience import CheckpointConfig, CheckpointError, CheckpointManager
from resilience.cli import main as cli
from resilience.storage.catalog import scan, verify
from resilience.storage.tiers import LocalTier

MiB = 1 << 20


def state(step: int) -> dict[str, object]:
    """2 MiB of step-derived values, so a few checkpoints fill a small file system."""
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(512, 1024, generator=gen), "step": step}


@contextlib.contextmanager
def small_fs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted with ``options``; skips where this process may not mount (not root, no CAP_SYS_ADMIN)."""
    path.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError:
        pytest.skip("no mount command here, so no size-limited file system to fill")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)


def fill(path: Path) -> None:
    """Take every byte still free (none may be left: then even creating the file fails)."""
    with contextlib.suppress(OSError), open(path, "wb") as stream:
        while True:
            stream.write(b"\0" * 4096)
            stream.flush()


def assert_loads(root: Path, step: int) -> None:
    for entry in scan(LocalTier(root)):
        if entry.committed:
            verify(entry, full=True)
    with CheckpointManager(CheckpointConfig(root, keep_last=3)) as m:
        restored = m.load()
        m.claim(resumed_from=step)  # what a restart does before its first save: clears dead writers' leftovers
    assert restored is not None and restored.step == step
    assert torch.equal(restored.state["w"], state(step)["w"])


def test_disk_full_during_the_shard_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with small_fs(tmp_path / "disk", "size=5m") as disk:
        with CheckpointManager(CheckpointConfig(disk, keep_last=3)) as m:
            for step in (1, 2):
                m.save(step, state(step))
                m.wait()
            m.save(3, state(3))
            with pytest.raises(
                CheckpointError, match=r"Writing the checkpoint failed: .*the disk is full.*step=3, tier=local"
            ):
                m.wait()
        assert (disk / "step-3").exists() and not (disk / "step-3" / "manifest.json").exists()
        assert cli(["verify", str(disk)]) == 0  # the failed save is an unfinished folder: listed, not failed
        report = capsys.readouterr().out
        assert "SKIP step 3" in report and "OK   step 2" in report and "OK   step 1" in report
        fill(disk / "filler")  # whatever the failed save left free (a page or so) is taken too
        assert_loads(disk, 2)  # a restart on the full disk resumes, and clearing the partial step 3 frees space
        assert "is full: resuming works" in caplog.text
        assert not (disk / "step-3").exists()
        assert cli(["verify", str(disk)]) == 0


def test_no_room_left_for_the_manifest(tmp_path: Path) -> None:
    with small_fs(tmp_path / "disk", "size=64m,nr_inodes=1000") as disk:
        with CheckpointManager(CheckpointConfig(disk, keep_last=3)) as m:
            m.save(1, {"w": state(1)["w"][:4]})
            m.wait()
            # its directory, its files, and the writer record it holds until the commit
            per_checkpoint = 1 + len(os.listdir(disk / "step-1")) + 1
            stats = os.statvfs(disk)
            limit = stats.f_files - stats.f_ffree + per_checkpoint - 1  # every file of step 2 but its manifest
            subprocess.run(["mount", "-o", f"remount,nr_inodes={limit}", str(disk)], check=True, timeout=30)
            m.save(2, {"w": state(2)["w"][:4]})
            with pytest.raises(
                CheckpointError, match=r"Committing the checkpoint failed: .*No space left on device.*step=2"
            ):
                m.wait()
        assert (disk / "step-2" / "state.json").exists() and not (disk / "step-2" / "manifest.json").exists()
        assert not [p for p in os.listdir(disk / "step-2") if p.startswith(".manifest")], "temporary file left"
        with CheckpointManager(CheckpointConfig(disk, keep_last=3)) as m:
            restored = m.load()
        assert restored is not None and restored.step == 1
        assert torch.equal(restored.state["w"], state(1)["w"][:4])


def test_durable_tier_full_keeps_the_local_commit_and_the_older_upload(tmp_path: Path) -> None:
    with small_fs(tmp_path / "remote", "size=3m") as remote:
        config = CheckpointConfig(
            tmp_path / "local",
            durable_url=f"file://{remote}",
            keep_last=3,
            upload_retries=1,
            upload_backoff_s=0.01,
            on_upload_error="warn",
        )
        with CheckpointManager(config) as m:
            m.save(1, state(1))
            assert m.wait(durable=True)
            second = m.save(2, state(2))
            assert second is not None and second.committed.result(60)
            with pytest.raises(CheckpointError, match=r"Uploading the checkpoint failed: .*No space left on device"):
                second.durable.result(60)
            third = m.save(3, {"w": state(3)["w"][:4], "step": 3})  # training goes on (on_upload_error="warn")
            assert third is not None and third.committed.result(60)
        assert (tmp_path / "local" / "step-2" / "manifest.json").exists()
        assert not (remote / "step-2" / "manifest.json").exists()
        assert_loads(remote, 1)
