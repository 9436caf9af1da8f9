"""Lightning's child-process observer (rank 0 under Lightning's own launcher) and the pack's last saves.

A real observer over real processes: the "children" are processes that exit with a given code, and the process
it would SIGKILL as rank 0 is a sleeping stand-in, so the test's own process is never the one killed. The whole
runs, a survivor save and a stop that outlast the observer's poll, are in tests/test_lightning.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from lightning_resilience.launcher_observer import _defer
from resilience.recovery.peer_loss import PeerLossConfig


def exited(code: int) -> subprocess.Popen[bytes]:
    """A child rank that has ended with ``code`` (negative: killed by that signal)."""
    end = f"import os; os.kill(os.getpid(), {-code})" if code < 0 else f"raise SystemExit({code})"
    child = subprocess.Popen([sys.executable, "-c", end])
    child.wait()
    return child


def stand_in_for_rank_0() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


class Session:
    """What the observer's patience reads of a training session: its survivor-save settings and whether its
    watch runs; no health guard (its codes and timers are read the same way)."""

    def __init__(self, peers: PeerLossConfig | None, watching: bool) -> None:
        self.peers = SimpleNamespace(config=peers)
        self.health = SimpleNamespace(guard=None)
        self.peer_watch = object() if watching else None
        self.ended = False


@pytest.mark.parametrize(
    ("code", "peers", "watching"),
    [(3, None, False), (-9, PeerLossConfig(), False)],
    ids=["survivor-saves-off", "training-over"],
)
def test_a_crash_the_pack_does_not_handle_is_ended_at_once_as_lightning_does(
    code: int, peers: PeerLossConfig | None, watching: bool
) -> None:
    rank_0 = stand_in_for_rank_0()
    observer = _ChildProcessObserver(main_pid=rank_0.pid, child_processes=[exited(code)])
    live = Session(peers, watching)
    _defer(observer, live)  # type: ignore[arg-type]
    assert observer._run() is True
    assert rank_0.wait(timeout=10) == -9


def test_a_lost_rank_leaves_the_survivors_their_rescue_time_then_lightning_ends_them() -> None:
    peers = PeerLossConfig(stale_s=0.2, heartbeat_s=0.1, grace_s=0.2)  # a rescue of at most 5.5 s
    rank_0 = stand_in_for_rank_0()
    observer = _ChildProcessObserver(main_pid=rank_0.pid, child_processes=[exited(-9)])
    live = Session(peers, watching=True)  # held, as the plugin holds its session while it trains
    _defer(observer, live)  # type: ignore[arg-type]
    waiting = threading.Thread(target=observer._run)
    waiting.start()
    time.sleep(1.0)
    assert rank_0.poll() is None, "rank 0 was killed while its survivor save may still run"
    waiting.join(timeout=30)
    assert rank_0.wait(timeout=10) == -9, "after the rescue's time, Lightning's kill goes on"
