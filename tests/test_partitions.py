"""A stall is a failure: a network cut that kills nothing still ends in a save and a restart within a bound.

Two nodes, each its own network namespace with a real address, joined by a veth pair (:mod:`tests.netns`); one
``resilience launch`` per node, one rank each, an Accelerate job with the health watch on, node-local roots and a
shared ``file://`` durable folder. The cut is the link taken down (``ip link set ... down``): every process stays
alive, and TCP peers just stop answering, as in a real partition.

- Cut for good: node 0 (which holds the job's store) declares node 1 lost once its launcher's heartbeat has stood
  ``--node-lost-s``; node 0's rank saves what its replica holds (a survivor save, local then durable), leaves the
  collective it is stuck in, and node 0's launcher exits 75. Node 1's launcher finds its store calls unanswered
  after ``--store-timeout-s``, ends its rank and exits 75. Nothing is committed on node 1 after the cut.
- Cut for 6 s: ridden out, with no restart at all.

Also here: a hang the watchdog reported that goes on past ``hang_exit_s`` ends the process (exit 69) instead of
waiting for a collective or a read that may never end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilience.cli import main as resilience_cli
from tests import netns
from tests.helpers import ROOT, WORKERS, base_env, free_port, kill_tree
from tests.test_inplace import node_env
from tests.test_preemption_delivery import assert_none_left, family

pytestmark = [
    pytest.mark.skipif(not netns.available(), reason="network namespaces need root and iproute2"),
    pytest.mark.timeout(300),
]
ACCELERATE = WORKERS / "accelerate_train.py"
BOUND_S = 10.0  # --node-lost-s and --store-timeout-s in these tests (30 by default)
SURVIVOR_SAVE = re.compile(r"survivor save of step (\d+) by ranks \[0\] \(lost: \[1\]\): committed")


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in root.glob("step-*/manifest.json"))


def start_nodes(
    hosts: netns.TwoHosts,
    out: Path,
    epochs: int,
    extra: dict[str, str] | None = None,
    bounds: list[str] | None = None,
    nodes: tuple[tuple[int, str], ...] = ((0, "a"), (1, "b")),
    endpoint: str | None = None,
) -> list[subprocess.Popen[bytes]]:
    """One launcher per node (``nodes``: node rank and host), logging to ``out/node-<N>.log`` (appended to)."""
    endpoint = endpoint or f"{hosts.addresses['a']}:{free_port()}"
    bounds = bounds if bounds is not None else [f"--node-lost-s={BOUND_S}", f"--store-timeout-s={BOUND_S}"]
    procs = []
    for node, host in nodes:
        env = node_env(
            out,
            out / f"node-{node}",
            ACCELERATE_RESILIENCE_HEALTH="1",
            TRAIN_STEP_SLEEP="0.5",
            TRAIN_EPOCHS=str(epochs),
            GLOO_SOCKET_IFNAME=hosts.interface(host),  # gloo would take the hostname's address, which both share
            **(extra or {}),
        )
        command = [sys.executable, "-m", "resilience.cli", "launch", "--nproc-per-node=1", "--nnodes=2"]
        command += [f"--node-rank={node}", f"--rdzv-endpoint={endpoint}", "--recovery-timeout-s=20"]
        command += [*bounds, "--stop-grace-s=20", str(ACCELERATE), str(out)]
        with (out / f"node-{node}.log").open("a") as sink:
            procs.append(
                subprocess.Popen(
                    hosts.run_in(host, command),
                    env=env,
                    cwd=ROOT,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def wait_for_durable_step(out: Path, step: int, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while step not in committed(out / "durable"):
        logs = [(out / f"node-{n}.log").read_text()[-3000:] for n in (0, 1)]
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, logs
        time.sleep(0.1)


def wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    return [p.poll() for p in procs]


# every background write (in the checkpoint helper) first leaves writing-<step> in the local root and waits 2 s
SLOW_WRITES = {
    "ACCELERATE_RESILIENCE_PERSIST": "process",
    "RESILIENCE_HELPER_PRELOAD": "tests.workers.helper_faults",
    "TEST_HELPER_FAULT": "slow_write",
    "TEST_SLOW_WRITE_S": "2",
}


# between saves: the same cut and the same survivor save as during one, without the save in flight
@pytest.mark.parametrize("when", [pytest.param("between_saves", marks=pytest.mark.slow), "during_a_save"])
def test_a_permanent_cut_ends_both_sides_and_node_0_saves_what_its_replica_holds(tmp_path: Path, when: str) -> None:
    with netns.two_hosts() as hosts:
        procs = start_nodes(hosts, tmp_path, epochs=40, extra=SLOW_WRITES if when == "during_a_save" else None)
        pids: list[int] = []
        try:
            wait_for_durable_step(tmp_path, 8, procs)
            if when == "during_a_save":  # both nodes' writes of step 12 under way
                while not all((tmp_path / f"node-{n}" / "writing-12").exists() for n in (0, 1)):
                    time.sleep(0.02)
            pids = [pid for proc in procs for pid in family(proc)]  # type: ignore[arg-type]
            before = max(committed(tmp_path / "durable"))
            hosts.cut()
            # without the bounds, both sides waited in their collectives and store calls (gloo's timeout: 30 min)
            codes = wait_all(procs, 6 * BOUND_S + 60)
        finally:
            for proc in procs:
                kill_tree(proc)
    node_0, node_1 = ((tmp_path / f"node-{n}.log").read_text() for n in (0, 1))
    assert codes == [75, 75], (codes, node_0[-4000:], node_1[-4000:])
    assert "node 1 lost: its launcher's heartbeat stood" in node_0, node_0[-4000:]
    saved = [int(step) for step in SURVIVOR_SAVE.findall(node_0)]
    assert len(saved) == 1 and saved[0] >= before, node_0[-4000:]
    assert saved[0] in committed(tmp_path / "durable") and saved[0] in committed(tmp_path / "node-0")
    assert resilience_cli(["verify", (tmp_path / "durable").as_uri()]) == 0  # every committed step, whole
    assert "this node is cut off: ending the ranks on this node" in node_1, node_1[-4000:]
    # nothing committed on the cut-off side after the cut: no save there could be agreed
    assert max(committed(tmp_path / "node-1")) <= before, committed(tmp_path / "node-1")
    assert_none_left(pids)


def test_a_short_cut_is_ridden_out_with_no_restart(tmp_path: Path) -> None:
    with netns.two_hosts() as hosts:
        procs = start_nodes(hosts, tmp_path, epochs=8)
        try:
            wait_for_durable_step(tmp_path, 8, procs)
            hosts.cut()
            time.sleep(6)
            hosts.mend()
            codes = wait_all(procs, 240)
        finally:
            for proc in procs:
                kill_tree(proc)
    output = "".join((tmp_path / f"node-{n}.log").read_text() for n in (0, 1))
    assert codes == [0, 0], output[-6000:]
    assert "node 1 lost:" not in output and "this node is cut off" not in output, output[-6000:]
    assert "generation 1" not in output, output[-6000:]
    assert output.count("DONE rank=") == 2, output[-6000:]


STUCK_STEP = """
import os, sys
from resilience.health import HealthConfig
from resilience.session import SaveState, TrainingSession
from resilience.config import CheckpointConfig
from resilience.checkpoint.manager import CheckpointManager
import torch, time

root, fifo = sys.argv[1], sys.argv[2]
session = TrainingSession(CheckpointManager(CheckpointConfig(root)), lambda step: SaveState({"step": step}))
session.use_health(HealthConfig(nvml=False, hang_min_s=1.0, hang_min_samples=3, hang_exit_s=2.0))
session.start(0)
for step in range(1, 100):
    session.step_begin(step - 1)
    if step == 6:
        print("STUCK", flush=True)
        open(fifo).read()  # a read from storage that never answers: blocked in the kernel, no timeout
    time.sleep(0.05)
    session.step_end(step)
print("NOT REACHED", flush=True)
"""


def test_a_hang_past_hang_exit_s_ends_the_process_for_a_restart(tmp_path: Path) -> None:
    """One process whose step blocks in a read that never returns (a FIFO nobody writes, as a hung mount): the
    watchdog reports the hang, and once it has gone on ``hang_exit_s`` the process leaves with code 69."""
    fifo = tmp_path / "never"
    os.mkfifo(fifo)
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_STEP)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(fifo)],
        env=base_env({"PYTHONPATH": str(ROOT)}),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "STUCK" in done.stdout and "NOT REACHED" not in done.stdout, done.stdout + done.stderr[-4000:]
    assert done.returncode == 69, done.stderr[-4000:]
    assert "degraded fault (hang)" in done.stderr and "past the hang report (hang_exit_s)" in done.stderr
