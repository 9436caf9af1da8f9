"""How a test's victim rank dies mid-run: once its state of the last boundary is where the survivors read it.

A rank killed within milliseconds of a step boundary can die before its heartbeat thread wrote that boundary's
RNG and data position; the survivors then commit without them and say so (docs/HEALTH.md, "A lost rank's own
state"). Tests that check a bit-exact resume need that state, so their victim waits for it rather than for a fixed
time, which under a loaded machine was sometimes too short.
"""

from __future__ import annotations

import os
import signal
import time

from resilience.session import TrainingSession


def die_after_boundary(session: TrainingSession, step: int, how: signal.Signals = signal.SIGKILL) -> None:
    """Send ``how`` to this process once its own state of the boundary after ``step`` is published; where
    survivor saves are off (nobody reads that state then), once the last save is committed in every tier, so
    that the test knows which step the job resumes from."""
    watch = session.peer_watch
    if watch is None or not session.manager.local_shared:  # node-local disks: no survivor save for a lost rank
        assert session.manager.wait(60, durable=True), "the victim's last save did not commit"
        os.kill(os.getpid(), how)
        return
    deadline = time.monotonic() + 60
    while True:
        found = watch.liveness.boundary_state(watch.manager.rank)
        if found is not None and found[0] == step:
            break
        assert time.monotonic() < deadline, f"rank {watch.manager.rank} never published its state of step {step}"
        time.sleep(0.01)
    os.kill(os.getpid(), how)
