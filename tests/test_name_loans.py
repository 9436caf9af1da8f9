"""A name written from the staging buffers its step was written from, not read back from the step's files; the
buffers lent for it stay as they were until it is written, so the next save waits (or skips) for them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint import staging_area
from resilience.checkpoint.save_handle import Commit, SaveHandle
from resilience.errors import CheckpointError
from resilience.formats.names import NameWriter, publish
from resilience.storage.tiers import LocalTier


def _zero_in_shards(step_dir: Path, tensor: torch.Tensor) -> None:
    """Overwrite ``tensor``'s bytes in the step's shard files with zeros (a committed step the disk corrupted)."""
    raw = tensor.numpy().tobytes()
    found = 0
    for shard in step_dir.glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at : at + len(raw)] = bytes(len(raw))
            shard.write_bytes(bytes(data))
            found += 1
    assert found == 1, f"{found} shard files hold the tensor's bytes"


def _names_held_back(manager: CheckpointManager, *, off_process: bool, lend: bool) -> tuple[NameWriter, SaveHandle]:
    """A writer whose queue waits behind a name of a save that never commits, until the handle returned fails."""
    run = manager.call_off_process if off_process else None
    names = NameWriter(manager.local, off_process=run, lend=manager.lend_staged if lend else None)
    blocker = SaveHandle(0)  # not the manager's: nothing is lent for it, and it commits when the test says
    names.add(str(Path(manager.local.root).parent / "blocker.ckpt"), 0, ["state_dict"], blocker, run_id=None)
    return names, blocker


@pytest.mark.parametrize(
    ("persist", "lend"), [("thread", True), ("process", True), ("thread", False)], ids=["thread", "process", "no-loan"]
)
def test_a_name_is_written_from_the_buffers_its_step_was_written_from(tmp_path: Path, persist: str, lend: bool) -> None:
    state = {"w": torch.randn(300, 100), "b": torch.randn(7)}
    name = tmp_path / "out" / "step3.ckpt"
    config = CheckpointConfig(local_root=tmp_path / "ckpt", persist=persist)  # type: ignore[arg-type]
    with CheckpointManager(config) as manager:
        names, blocker = _names_held_back(manager, off_process=persist == "process", lend=lend)
        handle = manager.save(3, {"state_dict": state}, extra={"adapter": "lightning"})
        assert handle is not None
        written = names.add(str(name), 3, ["state_dict"], handle, run_id=None)
        handle.committed.result()
        _zero_in_shards(tmp_path / "ckpt" / "step-3", state["w"])  # after the commit, before the name
        blocker.fail(CheckpointError("not this one"))
        written.result()
    loaded = torch.load(name, weights_only=True)["state_dict"]
    assert torch.equal(loaded["b"], state["b"])
    if lend:  # the bytes the step was written from, whatever the disk did to them since
        assert torch.equal(loaded["w"], state["w"])
    else:  # read back from the files (the control: this test sees where a name's bytes come from)
        assert not loaded["w"].any()


@pytest.mark.parametrize("when_busy", ["wait", "skip", "second-set"])
def test_the_next_save_leaves_lent_buffers_alone_until_the_name_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when_busy: str
) -> None:
    """With one set of staging buffers (a large state), the next save waits for the loan, or is skipped; a small
    state's next save goes to a second set at once. Either way the name gets the lent save's values."""
    two_sets = when_busy == "second-set"
    if two_sets:
        when_busy = "wait"
    else:
        monkeypatch.setattr(staging_area, "SETS_BYTES", 1024)
    first = {"w": torch.randn(300, 100)}
    name = tmp_path / "out" / "step3.ckpt"
    config = CheckpointConfig(local_root=tmp_path / "ckpt", persist="thread", when_busy=when_busy)  # type: ignore[arg-type]
    with CheckpointManager(config) as manager:
        names, blocker = _names_held_back(manager, off_process=False, lend=True)
        handle = manager.save(3, {"state_dict": first}, extra={"adapter": "lightning"})
        assert handle is not None
        written = names.add(str(name), 3, ["state_dict"], handle, run_id=None)
        handle.committed.result()  # committed, but its buffers are still lent to the name queued behind
        second: list[SaveHandle | None] = []
        then = {"state_dict": {"w": first["w"] + 1}}
        saving = threading.Thread(target=lambda: second.append(manager.save(5, then, extra={"adapter": "lightning"})))
        saving.start()
        if two_sets:
            saving.join()
            assert second[0] is not None and manager.stats.waited_for_previous == 0
            assert len(manager._staging_area.sets) == 2 and not written.done()
        elif when_busy == "wait":
            saving.join(1.0)
            assert saving.is_alive(), "the next save copied into buffers lent to a name not yet written"
            assert not written.done()
        else:
            saving.join()
            assert second == [None] and manager.stats.skipped == 1  # skipped, as with a save still being written
        blocker.fail(CheckpointError("not this one"))
        written.result()
        saving.join()
        if when_busy == "wait":
            assert second[0] is not None and manager.stats.waited_for_previous == (0 if two_sets else 1)
            assert second[0].committed.result().step == 5
    assert torch.equal(torch.load(name, weights_only=True)["state_dict"]["w"], first["w"])


@pytest.mark.parametrize("commits", [True, False], ids=["committed", "failed"])
def test_a_name_written_at_once_is_written_while_its_step_commits_and_is_the_name_only_after(
    tmp_path: Path, commits: bool
) -> None:
    """A small checkpoint's name, there when ``save_checkpoint`` returns: its file is written while the step
    commits, and becomes the name once the step is committed; a step that fails to commit leaves no name."""
    names = NameWriter(LocalTier(str(tmp_path / "ckpt")))
    checkpoint = {"state_dict": {"w": torch.randn(8, 8)}, "global_step": 1}
    path, handle, raised = tmp_path / "names" / "a.ckpt", SaveHandle(1), []

    def name() -> None:
        try:
            publish(names, str(path), 1, checkpoint, handle, run_id=None, now=True)
        except CheckpointError as exc:
            raised.append(exc)

    call = threading.Thread(target=name)
    call.start()
    deadline = time.monotonic() + 30
    while not list(path.parent.glob(".a.ckpt.tmp-*")):  # written while the step is not committed yet
        assert time.monotonic() < deadline, "nothing was written before the commit"
        time.sleep(0.01)
    assert not path.exists()
    if commits:
        handle.committed.set_result(Commit(1, "local", str(tmp_path / "ckpt" / "step-1"), 0))
    else:
        handle.fail(CheckpointError("not saved", step=1))
    call.join(30)
    assert list(path.parent.iterdir()) == ([path] if commits else [])  # no temporary file left either way
    assert bool(raised) is not commits
    if commits:
        assert torch.equal(torch.load(path, weights_only=True)["state_dict"]["w"], checkpoint["state_dict"]["w"])
