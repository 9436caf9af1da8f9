"""A checkpoint is set aside at resume only on evidence that it is damaged, never because its read was cut short.

Evidence is a file missing, or at a size or checksum other than its manifest's. A stop signal during the read
(whose ``SystemExit`` DCP's load catches and hands back wrapped), storage that fails to answer, or bytes that match
their manifest and still do not parse leave the copy where it is. Signals here are real ones, sent to the process
by the operating system while it is inside DCP's read. The multi-rank cases, with signals as launchers deliver
them, are in ``test_preemption_delivery.py``.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from resilience.checkpoint.restore import Restorer
from resilience.cli import main as cli
from resilience.storage.dcp_fs import LoadFileSystem
from tests.helpers import ROOT, base_env, reseal
from tests.test_engine_local import make_state, manager

SIGNALLED_READ = """
import os, signal, sys, time
from contextlib import contextmanager
from pathlib import Path

from resilience.health.signals import SignalWatcher
from resilience.health.faults import FaultTable
from resilience.storage import catalog
from resilience.storage.dcp_fs import LoadFileSystem
from tests.test_engine_local import manager

def stop_here():  # the operating system's SIGTERM; the handler's SystemExit ends the sleep
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

if sys.argv[2] == "read":  # inside DCP's read, as it opens a shard
    create_stream = LoadFileSystem.create_stream

    @contextmanager
    def signalled(self, path, mode):
        stop_here()
        with create_stream(self, path, mode) as stream:
            yield stream

    LoadFileSystem.create_stream = signalled
else:  # while discovery hashes the files against the manifest
    check_file = catalog.check_file

    def signalled(*args, **kwargs):
        stop_here()
        return check_file(*args, **kwargs)

    catalog.check_file = signalled
SignalWatcher(["SIGTERM"], None, FaultTable(), exit_code=75, exit_timeout_s=60).install()  # before training
with manager(Path(sys.argv[1]), keep_last=3, verify="full") as m:
    m.load()
print("LOADED", flush=True)  # not reached
"""


def saved_steps(root: Path, steps: tuple[int, ...] = (1, 2), **settings: object) -> None:
    with manager(root, keep_last=3, **settings) as m:
        for step in steps:
            m.save(step, make_state(step))


@pytest.mark.parametrize("where", ["read", "verify"])
def test_a_stop_signal_during_a_restore_exits_with_its_code_and_sets_nothing_aside(tmp_path: Path, where: str) -> None:
    """A SIGTERM before training, during discovery's checksums or inside DCP's read (which catches the handler's
    ``SystemExit`` on its way out): the process leaves with the requeue code, and the copy it was reading stays
    where it was, to be resumed from next time."""
    saved_steps(tmp_path)
    script = tmp_path / "signalled_read.py"
    script.write_text(SIGNALLED_READ)
    env = base_env({"PYTHONPATH": str(ROOT)})  # a whole shutdown, without the suite's fast exit (conftest.py)
    command = [sys.executable, str(script), str(tmp_path), where]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "SIGTERM before training began: exiting with code 75" in done.stderr, done.stderr[-4000:]
    assert done.returncode == 75, done.stderr[-4000:]
    assert "LOADED" not in done.stdout and "Skipping" not in done.stderr, done.stderr[-4000:]
    assert not (tmp_path / "quarantine").exists()
    with manager(tmp_path, keep_last=3) as m:
        restored = m.load()
    assert restored is not None and restored.step == 2
    assert torch.equal(restored.state["model"]["w"], make_state(2)["model"]["w"])


@contextmanager
def failing_reads(error: OSError) -> Generator[None, None, None]:
    """The storage fails every shard read with ``error``, as an I/O error or a dropped mount does."""
    create_stream = LoadFileSystem.create_stream

    @contextmanager
    def failing(self: LoadFileSystem, path: str, mode: str) -> Generator[object, None, None]:
        if self.entry.step == 2:
            raise error
        with create_stream(self, path, mode) as stream:
            yield stream

    LoadFileSystem.create_stream = failing  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        LoadFileSystem.create_stream = create_stream  # type: ignore[method-assign]


@pytest.mark.parametrize("code", [errno.EIO, errno.ETIMEDOUT, errno.EINTR])
def test_storage_that_fails_to_answer_leaves_the_copy_in_place(tmp_path: Path, code: int) -> None:
    saved_steps(tmp_path)
    skipped = r"Skipping step 2 .* for now: .*it stays in place; trying"
    with (
        failing_reads(OSError(code, "the storage failed")),
        manager(tmp_path, keep_last=3) as m,
        pytest.warns(UserWarning, match=skipped),
    ):
        restored = m.load()
    assert restored is not None and restored.step == 1
    assert (tmp_path / "step-2" / "manifest.json").exists() and not (tmp_path / "quarantine").exists()
    with manager(tmp_path, keep_last=3) as m:  # the storage answers again: the newest step is resumed
        restored = m.load()
    assert restored is not None and restored.step == 2


def spoil_header(shard: Path) -> None:
    """Bytes that no longer parse: the first entry's zip header inverted."""
    data = bytearray(shard.read_bytes())
    data[:40] = bytes(b ^ 0xFF for b in data[:40])
    shard.write_bytes(bytes(data))


def test_bytes_that_match_their_manifest_but_do_not_parse_stay_in_place(tmp_path: Path) -> None:
    """What was written is what is there, so the copy is not damaged: it may need another release to read (or hold
    a writer's bug). It is skipped, and kept for the user."""
    saved_steps(tmp_path)
    shard = next((tmp_path / "step-2").glob("__*.distcp"))
    spoil_header(shard)
    reseal(tmp_path / "step-2", shard.name)
    assert cli(["verify", str(tmp_path), "--step", "2"]) == 0
    kept = r"every file matches its manifest, so the copy stays in place"
    with manager(tmp_path, keep_last=3) as m, pytest.warns(UserWarning, match=kept):
        restored = m.load()
    assert restored is not None and restored.step == 1
    assert (tmp_path / "step-2" / "manifest.json").exists() and not (tmp_path / "quarantine").exists()


def test_a_read_that_fails_on_bytes_changed_since_discovery_sets_the_copy_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify="full"`` hashed the shards before the read, so the read does not hash them again; they change in
    between, the parse fails, and hashing them again is the evidence that sets the copy aside."""
    saved_steps(tmp_path)
    shard = next((tmp_path / "step-2").glob("__*.distcp"))
    load_entry = Restorer.load_entry

    def changed_first(self: Restorer, entry: object, *args: object, **kwargs: object) -> object:
        if getattr(entry, "step", None) == 2:
            spoil_header(shard)
        return load_entry(self, entry, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Restorer, "load_entry", changed_first)
    evidence = r"checking it against its manifest: .*__0_0.distcp has checksum"
    with manager(tmp_path, keep_last=3, verify="full") as m, pytest.warns(UserWarning, match=evidence):
        restored = m.load()
    assert restored is not None and restored.step == 1
    assert [p.name.split("-")[1] for p in (tmp_path / "quarantine").iterdir()] == ["2"]


def test_a_fresh_start_names_the_steps_set_aside_and_how_to_put_one_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved_steps(tmp_path, steps=(3,))
    shard = next((tmp_path / "step-3").glob("__*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])  # evidence: its size is not the manifest's
    with manager(tmp_path, keep_last=3) as m, pytest.warns(UserWarning, match="Skipping step 3"):
        caplog.set_level(logging.WARNING, logger="resilience.checkpoint.restore")
        assert m.load() is None
    aside = next((tmp_path / "quarantine").iterdir())
    notes = [r.getMessage() for r in caplog.records if "starts from step 0" in r.getMessage()]
    assert len(notes) == 1, caplog.text
    assert "steps 3 are set aside as corrupt" in notes[0] and f"mv {aside} {tmp_path / 'step-3'}" in notes[0]
    assert f"resilience verify {tmp_path} --step 3" in notes[0]
    with manager(tmp_path, keep_last=3) as m:  # an empty root says nothing of the kind
        caplog.clear()
        aside.rename(tmp_path / "elsewhere")
        assert m.load() is None
    assert "starts from step 0" not in caplog.text
