"""The ranks a launcher starts side by side on a node (torchrun, ``accelerate launch``) fork their helpers from the
first rank's fork server (:class:`~resilience.persist.fork_server.SiblingServer`), take only a live sibling's, and
keep their helpers when that rank is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resilience.persist.fork_server import SHARE_VARIABLE, ForkServer
from resilience.storage.processes import process_start_ticks
from tests.helpers import WORKERS, accelerate_launch, base_env, kill_job

# A rank of a node of two started by this process: it says whose server its helper came from and its own server's.
RANK = (
    "import os, sys\n"
    "from resilience.persist import fork_server\n"
    "from resilience.persist.helper import call_in_helper\n"
    "fork_server.SIBLING_WAIT_S = 0.3\n"  # none is coming in the tests that find none: the test need not wait 3 s
    "fork_server.start_server_early()\n"
    "server = fork_server.ForkServer.get()\n"
    "own = server.process.pid if isinstance(server, fork_server.ForkServer) else None\n"
    "print(call_in_helper(os.getppid), own, flush=True)\n"
    "sys.stdin.readline()\n"  # until the test is done with it
)


def test_the_ranks_accelerate_launch_starts_share_one_server_and_keep_their_helpers_when_its_owner_dies(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    with (out / "launch.log").open("w") as log:
        command = accelerate_launch(WORKERS / "sibling_ranks.py", str(out))
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    try:
        proc.wait(timeout=180)
    finally:
        kill_job(proc)
    output = (out / "launch.log").read_text()
    assert (out / "after.json").exists(), output[-6000:]
    first, second, after = (json.loads((out / name).read_text()) for name in ("rank0.json", "rank1.json", "after.json"))
    shared = first["server"]
    assert first["forked_by"] == shared and (second["server"], second["forked_by"]) == (shared, shared), (first, second)
    # forked by rank 0's server, run as rank 1's: its training process, working directory and stdout
    assert second["settings_of"] == second["pid"] and second["helper_cwd"] == str(out / "work1"), second
    for rank in (0, 1):
        assert (out / f"work{rank}" / "stdout").read_text() == f"a helper of rank {rank}\n"
    forked_by, parent_at_the_end = after["held"]
    assert forked_by == shared != parent_at_the_end  # it ran on after rank 0 and its server were gone
    assert after["forked_by"] == after["own_server"] not in (shared, -1), after  # then a server of rank 1's own
    assert not os.path.exists(second["published"])  # rank 0's server removed its file as it ended


def test_a_rank_starts_its_own_server_where_the_published_one_is_stale(tmp_path: Path) -> None:
    # The first rank and its server killed at once (a launcher's SIGKILL to its process group): its file stays.
    first = _rank(0, tmp_path)
    forked_by, own = _answer(first)
    path = _published_for_children_of_this_process()
    stale = json.loads(path.read_text())
    assert stale["pid"] == own == forked_by
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    _wait_gone(stale["pid"])
    assert path.exists()
    _assert_own_server(_rank(1, tmp_path), {stale["pid"]})


def test_a_rank_takes_no_server_of_a_process_that_is_not_its_sibling(tmp_path: Path) -> None:
    # This test process's own server, published where the ranks it starts look: alive, the same code, but its
    # owner is their launcher, not one of them.
    server = ForkServer.get()
    assert isinstance(server, ForkServer)
    path = _published_for_children_of_this_process()
    path.write_text(server.share)
    path.chmod(0o600)
    try:
        _assert_own_server(_rank(1, tmp_path), {server.process.pid})
    finally:
        path.unlink()


def _rank(local_rank: int, cwd: Path) -> subprocess.Popen[str]:
    """A rank of a node of two, started by this process (the launcher of its siblings), in a session of its own."""
    env = base_env({"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2"})
    env.pop(SHARE_VARIABLE, None)  # a server this test's process shared (a Trainer made here did) is not a sibling's
    command = [sys.executable, "-c", RANK]
    return subprocess.Popen(
        command, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def _answer(rank: subprocess.Popen[str]) -> list[Any]:
    assert rank.stdout is not None
    line = rank.stdout.readline()
    assert line, f"the rank exited with {rank.wait()}"
    return [json.loads(word) if word != "None" else None for word in line.split()]


def _assert_own_server(rank: subprocess.Popen[str], not_from: set[int]) -> None:
    try:
        forked_by, own = _answer(rank)
        assert forked_by == own and own not in not_from
    finally:
        rank.kill()
        rank.wait()


def _published_for_children_of_this_process() -> Path:
    """Where the first rank of the processes this one starts publishes its server (read on disk, as a launcher
    would see it: its pid and start time)."""
    folder = Path(tempfile.gettempdir(), f"resilience-{os.getuid()}")
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"server-{os.getpid()}-{process_start_ticks(os.getpid())}.json"


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while process_start_ticks(pid) is not None:
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.02)
