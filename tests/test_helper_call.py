"""One function run in a helper process forked for it (how rank 0 writes Lightning's ``.ckpt`` names off the
training process): its result comes back, its exception is raised here, and a helper that dies is an error,
never a silent success."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.errors import CheckpointError
from resilience.formats import export
from resilience.formats.names import NameWriter, repaired_writer
from resilience.persist import PersistPipeline
from resilience.persist.fork_server import SHARE_VARIABLE, ForkServer, share_server
from resilience.persist.helper import HelperPipeline, call_in_helper
from tests.helpers import ROOT, WORKERS, base_env
from tests.workers.name_then_killed import state as killed_state


class Unrebuildable(Exception):
    def __init__(self, code: int, why: str):  # two required arguments: pickling keeps only str(self)
        super().__init__(f"{code}: {why}")


def _raise_unrebuildable() -> None:
    raise Unrebuildable(7, "no")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_call_runs_in_another_process_and_returns_its_result() -> None:
    assert call_in_helper(os.getpid) != os.getpid()
    assert call_in_helper(divmod, 17, 5) == (3, 2)
    assert call_in_helper(os.getenv, "RESILIENCE_HELPER_PARENT_PID") == str(os.getpid())


def test_a_calls_exception_is_raised_in_the_caller() -> None:
    with pytest.raises(FileNotFoundError):
        call_in_helper(os.stat, "/no/such/file/here")
    with pytest.raises(CheckpointError, match="7: no"):
        call_in_helper(_raise_unrebuildable)


def test_a_helper_that_dies_mid_call_is_an_error() -> None:
    with pytest.raises(CheckpointError, match="died before it finished"):
        call_in_helper(_die)


def test_a_preload_module_the_helpers_cannot_import_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module in ``RESILIENCE_HELPER_PRELOAD`` that the helpers cannot import fails the call and the save with
    what to change, not with the end of a connection; nothing is committed."""
    monkeypatch.setenv("RESILIENCE_HELPER_PRELOAD", "no_such_drill_module")
    said = r"import 'no_such_drill_module', named in RESILIENCE_HELPER_PRELOAD: ModuleNotFoundError.*PYTHONPATH"
    with pytest.raises(CheckpointError, match=said):
        call_in_helper(os.getpid)
    manager = CheckpointManager(CheckpointConfig(tmp_path, persist="process"))
    manager.save(1, {"w": torch.ones(4)})
    with pytest.raises(CheckpointError, match=said):
        manager.wait()
    manager.close()
    assert not (tmp_path / "step-1" / "manifest.json").exists()


def test_the_fork_server_ends_with_its_training_process_and_removes_its_folder() -> None:
    # The server skips the interpreter's teardown at its end (os._exit): what it has to do, it does before.
    script = (
        "import os\n"
        "from resilience.persist.fork_server import ForkServer\n"
        "from resilience.persist.helper import call_in_helper\n"
        "call_in_helper(os.getpid)\n"  # the server is up, and has forked a helper
        "print(ForkServer.get().process.pid, ForkServer.get().folder)\n"
    )
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    pid, folder = done.stdout.split()  # read to its end: the server, which shares that stdout, has let go of it
    _wait_until_gone(int(pid))
    assert not os.path.exists(folder)


def test_a_client_gone_before_the_handshake_does_not_end_the_fork_server() -> None:
    """A rank killed (kill -9) while it connects to the node's fork server, or anything else that reaches its
    socket without the key, must not end the server: the node's other ranks ask it for their next helpers."""
    script = (
        "import os, socket, struct\n"
        "from resilience.persist.fork_server import ForkServer\n"
        "from resilience.persist.helper import call_in_helper\n"
        "call_in_helper(os.getpid)\n"  # the server is up
        "server = ForkServer.get()\n"
        "for _ in range(3):\n"
        "    with socket.socket(socket.AF_UNIX) as gone:\n"
        "        gone.connect(server.address)\n"  # and closed at once, before the server's challenge is answered
        "with socket.socket(socket.AF_UNIX) as stranger:\n"
        "    stranger.connect(server.address)\n"
        "    stranger.recv(1024)\n"  # the challenge
        "    stranger.sendall(struct.pack('!i', 4) + b'junk')\n"  # a wrong answer
        "    stranger.recv(1024)\n"
        "print(call_in_helper(divmod, 17, 5), server.alive())\n"
    )
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["(3,", "2)", "True"], done.stdout + done.stderr


def test_a_fork_server_started_early_goes_if_no_helper_was_wanted_from_it() -> None:
    # In a process of its own: this one's server may be another test's.
    script = (
        "import os\n"
        "from resilience.persist.fork_server import ForkServer, start_server_early, stop_early_server\n"
        "from resilience.persist.helper import call_in_helper\n"
        "start_server_early()\n"
        "early = ForkServer.get(early=True)\n"
        "stop_early_server()\n"  # the engine persists in threads: nothing was forked from it
        "assert early.process.poll() is not None and not os.path.exists(early.folder)\n"
        "assert call_in_helper(os.getpid) != os.getpid()\n"  # a new server, wanted
        "used = ForkServer.get(early=True)\n"
        "stop_early_server()\n"
        "assert used is not early and used.process.poll() is None\n"
    )
    subprocess.run([sys.executable, "-c", script], env=base_env(), cwd=ROOT, timeout=120, check=True)


def test_the_ranks_a_process_starts_fork_their_helpers_from_its_server_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # How Lightning's first rank of a node starts the others: they need not wait for servers of their own.
    monkeypatch.setenv(SHARE_VARIABLE, "")  # unset again after: later tests' processes start their own servers
    share_server()
    server = ForkServer.get()
    assert isinstance(server, ForkServer)
    rank = (
        "import os, sys\n"
        "from resilience.persist.fork_server import ForkServer\n"
        "from resilience.persist.helper import call_in_helper\n"
        "assert call_in_helper(os.getcwd) == os.getcwd()\n"  # the rank's working directory, not the server's
        "print(call_in_helper(os.getppid), call_in_helper(os.getenv, 'RESILIENCE_HELPER_PARENT_PID'), flush=True)\n"
        "sys.stdin.readline()\n"  # meanwhile the server this process was started with ends
        "print(call_in_helper(os.getppid), ForkServer.get().process.pid, flush=True)\n"
    )
    command = [sys.executable, "-c", rank]
    proc = subprocess.Popen(
        command, env=base_env(), cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        forked_by, settings_of = map(int, proc.stdout.readline().split())
        assert (forked_by, settings_of) == (server.process.pid, proc.pid)  # its server; its own settings
        server.stop()
        proc.stdin.write("\n")
        proc.stdin.flush()
        forked_by, own = map(int, proc.stdout.readline().split())
        assert forked_by == own != server.process.pid  # a server of its own now
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_name_written_off_process_is_the_committed_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # This process's file writer is broken: only a helper (forked from a clean server) can write the name.
    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("the name was written in the training process")

    monkeypatch.setattr(export, "write_torch_file", broken)
    state = {"w": torch.randn(300, 100)}
    with CheckpointManager(CheckpointConfig(local_root=tmp_path / "ckpt")) as manager:
        handle = manager.save(3, {"state_dict": state}, extra={"adapter": "lightning"})
        names = NameWriter(manager.local, off_process=call_in_helper)
        names.add(str(tmp_path / "out" / "last.ckpt"), 3, ["state_dict"], handle, run_id=None).result()
    loaded = torch.load(tmp_path / "out" / "last.ckpt", weights_only=True)
    assert torch.equal(loaded["state_dict"]["w"], state["w"])


@contextlib.contextmanager
def _drilled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drill: str) -> Iterator[CheckpointManager]:
    """A manager whose helpers, forked or not, run ``drill`` of ``tests/workers/name_writer_drill.py``."""
    monkeypatch.setenv("RESILIENCE_HELPER_PRELOAD", "tests.workers.name_writer_drill")
    monkeypatch.setenv("TEST_NAME_WRITER_DRILL", drill)
    with CheckpointManager(CheckpointConfig(local_root=tmp_path / "ckpt", persist="process")) as manager:
        yield manager


def _name_step_3(manager: CheckpointManager, name: Path, state: dict[str, torch.Tensor]) -> PersistPipeline:
    """Save ``state`` as step 3 and have rank 0's writer name it ``name``; the pipeline the save went to."""
    names = repaired_writer(manager)
    assert names is not None
    handle = manager.save(3, {"state_dict": state}, extra={"adapter": "lightning"})
    pipeline = manager.pipeline
    names.add(str(name), 3, ["state_dict"], handle, run_id=None).result()
    return pipeline


def test_a_name_is_written_by_the_ranks_helper_beside_its_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not by a helper forked for it: each would copy pages of the server's interpreter and import what it needs anew.
    pid_file, name, state = tmp_path / "writer.pid", tmp_path / "out" / "last.ckpt", {"w": torch.randn(300, 100)}
    with _drilled(tmp_path, monkeypatch, f"pid:{pid_file}") as manager:
        helper = _name_step_3(manager, name, state)
        assert isinstance(helper, HelperPipeline) and helper.pid is not None
        assert int(pid_file.read_text()) == helper.pid != os.getpid()
    assert torch.equal(torch.load(name, weights_only=True)["state_dict"]["w"], state["w"])


def test_a_name_whose_helper_is_ended_mid_file_is_written_again_in_a_helper_forked_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As when every rank's helper is restarted after a peer was lost: the name must not wait for the next start.
    died, name = tmp_path / "died", tmp_path / "out" / "last.ckpt"
    with _drilled(tmp_path, monkeypatch, f"die-once:{died}") as manager:
        state = {"w": torch.randn(300, 100)}
        first = _name_step_3(manager, name, state)
        assert died.exists(), "the drill did not end the helper mid-file"
        assert isinstance(first, HelperPipeline) and first.died is not None
        assert not list(name.parent.glob(".last.ckpt.tmp-*")), "the ended writer's temporary file stays behind"
        later = manager.save(4, {"state_dict": state}, extra={"adapter": "lightning"})  # with a new helper
        assert later is not None and later.committed.result().step == 4
        assert manager.pipeline is not first
    assert torch.equal(torch.load(name, weights_only=True)["state_dict"]["w"], state["w"])


def test_a_name_writer_killed_mid_file_leaves_no_name_and_the_next_start_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RESILIENCE_HELPER_PRELOAD", "tests.workers.name_writer_drill")
    monkeypatch.setenv("TEST_NAME_WRITER_DRILL", "die")
    state = {"w": torch.randn(300, 100)}
    name = tmp_path / "out" / "last.ckpt"
    with CheckpointManager(CheckpointConfig(local_root=tmp_path / "ckpt")) as manager:
        handle = manager.save(3, {"state_dict": state}, extra={"adapter": "lightning"})
        names = NameWriter(manager.local, off_process=call_in_helper)
        with pytest.raises(CheckpointError, match="died before it finished"):
            names.add(str(name), 3, ["state_dict"], handle, run_id=None).result()
        assert not name.exists()  # never half a file at the name: the helper died inside its temporary file
        (leftover,) = name.parent.glob(".last.ckpt.tmp-*")
        _wait_until_gone(int(leftover.name.split("-")[-2]))  # its connection closes before it has quite exited
        monkeypatch.setenv("TEST_NAME_WRITER_DRILL", "")
        again = NameWriter(manager.local, off_process=call_in_helper)  # the next start: the record says it is unwritten
        again.repair(manager.committed_steps())
        assert not list(name.parent.glob(".last.ckpt.tmp-*")), "the dead writer's temporary file stays behind"
        pending = again.pending(str(name))
        assert pending is not None
        pending.result()
    loaded = torch.load(name, weights_only=True)
    assert torch.equal(loaded["state_dict"]["w"], state["w"])


def test_a_name_being_written_when_its_training_process_is_killed_is_cut_short_and_written_by_the_next_start(
    tmp_path: Path,
) -> None:
    # An orphan that went on writing could replace a newer file the relaunch wrote at the same path.
    root, name, pid_file = tmp_path / "ckpt", tmp_path / "out" / "last.ckpt", tmp_path / "writer.pid"
    drill = {
        "RESILIENCE_HELPER_PRELOAD": "tests.workers.name_writer_drill",
        "TEST_NAME_WRITER_DRILL": f"hang:{pid_file}",
    }
    script = [sys.executable, str(WORKERS / "name_then_killed.py"), str(root), str(name)]
    proc = subprocess.Popen(script, env=base_env(drill), cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():  # the helper has written a record from shared memory, and hangs
            assert proc.poll() is None, f"the training process exited with code {proc.returncode}"
            assert time.monotonic() < deadline, "the name's helper wrote nothing from the lent buffers"
            time.sleep(0.05)
        writer = int(pid_file.read_text())
        assert psutil.pid_exists(writer) and writer != proc.pid
        proc.kill()  # kill -9 of the training process alone: its helpers are left to notice
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait_until_gone(writer)
    assert not name.exists()  # cut short inside its temporary file
    with CheckpointManager(CheckpointConfig(local_root=root)) as manager:  # the relaunch
        names = repaired_writer(manager)
        assert names is not None
        pending = names.pending(str(name))
        assert pending is not None, "the relaunch did not write the name again"
        pending.result()
    assert not list(name.parent.glob(".last.ckpt.tmp-*")), "the cut-short writer's temporary file stays behind"
    loaded, saved = torch.load(name, weights_only=True)["state_dict"], killed_state()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


def _wait_until_gone(pid: int, timeout: float = 30) -> None:
    """Until process ``pid`` has exited (a zombie has)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.02)
