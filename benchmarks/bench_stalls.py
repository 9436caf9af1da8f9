"""Stalls: how long a network cut and an unanswering durable tier hold a job, from the fault to each exit.

``partition``: two nodes in network namespaces joined by a veth pair (tests/netns.py), one ``resilience launch`` and
one Accelerate rank each (the health watch on, node-local roots, a shared ``file://`` durable folder, the default
``--node-lost-s 30 --store-timeout-s 30``, ``--node-wait-s 300``). Once durable step 8 exists the link goes down
for good. Measured from the cut: node 0 declares node 1 lost, its survivor save commits, each side's launcher or
rank leaves. Then the link comes back and a new launcher with ``--node-rank 1`` starts on node 1's host (a node
replaced), and the time from its start to the first step of the new generation is measured. Left to the transport
timeouts instead, both sides wait in their gloo collective for its default timeout, 30 minutes.

``grace``: a 2-rank Lightning job uploading to moto's S3 through a proxy (tests/s3_proxy.py), the health guard at
its default ``grace_s=25``. Once uploads flow, the proxy answers 40% of PUTs with 503 SlowDown (``throttled``) or
none at all (``hung``), and SIGTERM reaches every process of the job, as SLURM sends it. Measured: the signal to the
job's exit, and its code.

Needs root (network namespaces). One run of each takes one to three minutes::

    .venv/bin/python -m benchmarks.bench_stalls [--repeats 1]
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import emit, machine, markdown_table, parse, parser, scratch
from tests import netns
from tests.helpers import S3_ENV, MotoServer, kill_tree
from tests.s3_proxy import FaultProxy
from tests.test_partitions import committed, start_nodes, wait_for_durable_step
from tests.test_preemption_delivery import deliver, start_lightning, wait_for

DEFAULT_BOUNDS = ["--node-lost-s=30", "--store-timeout-s=30", "--node-wait-s=300"]


def _until(condition: Callable[[], bool], since: float, limit_s: float = 600) -> float:
    """Seconds from ``since`` until ``condition`` holds (polled every 50 ms)."""
    while not condition():
        if time.monotonic() - since > limit_s:
            raise TimeoutError("not reached")
        time.sleep(0.05)
    return time.monotonic() - since


def _first_step_of_new_incarnation(root: Path, seen: int) -> bool:
    """Whether node 0's goodput ledger has an incarnation newer than the first ``seen`` with a first step."""
    files = sorted((root / "goodput").glob("incarnation-*.jsonl"))
    return any('"e":"first_step"' in f.read_text() for f in files[seen:])


def partition_once(out: Path) -> dict[str, Any]:
    """One permanent cut, then a replacement node; the seconds each stage took (see the module)."""
    with netns.two_hosts() as hosts:
        endpoint = f"{hosts.addresses['a']}:{os.getpid() % 20000 + 30000}"
        procs = start_nodes(hosts, out, epochs=60, bounds=DEFAULT_BOUNDS, endpoint=endpoint)
        try:
            wait_for_durable_step(out, 8, procs)
            incarnations = len(list((out / "node-0" / "goodput").glob("incarnation-*.jsonl")))
            cut = time.monotonic()
            hosts.cut()
            node_0 = out / "node-0.log"
            row: dict[str, Any] = {"variant": "partition"}
            row["declared_s"] = _until(lambda: "node 1 lost:" in node_0.read_text(), cut)
            row["survivor_commit_s"] = _until(lambda: "survivor save of step" in node_0.read_text(), cut)
            row["node_1_exit_s"] = _until(lambda: procs[1].poll() is not None, cut)
            row["node_1_code"] = procs[1].returncode
            row["node_0_rank_out_s"] = _until(lambda: "stuck in a collective" in node_0.read_text(), cut)
            hosts.mend()
            joined = time.monotonic()
            procs += start_nodes(hosts, out, epochs=60, bounds=DEFAULT_BOUNDS, nodes=((1, "b"),), endpoint=endpoint)
            row["replacement_to_first_step_s"] = _until(
                lambda: _first_step_of_new_incarnation(out / "node-0", incarnations), joined
            )
            row["cut_to_first_step_s"] = time.monotonic() - cut
            row["durable_steps"] = committed(out / "durable")[-3:]
        finally:
            for proc in procs:
                kill_tree(proc)
    return row


def grace_once(out: Path, storage: str, moto: MotoServer) -> dict[str, Any]:
    """SIGTERM to every process of a job whose uploads are ``storage`` (throttled or hung): to its exit."""
    import s3fs

    bucket = f"bench-stalls-{storage}-{time.time_ns()}"
    s3fs.S3FileSystem(endpoint_url=moto.endpoint).mkdir(bucket)
    proxy = FaultProxy(moto.endpoint).start()
    env = {"TEST_STORAGE_OPTIONS": json.dumps({"endpoint_url": proxy.endpoint}), **S3_ENV}
    args = ["--durable", f"s3://{bucket}/run", "--grace", "25", "--step-sleep", "0.3", "--max-steps", "600"]
    proc, log = start_lightning(out, *args, env=env)
    try:
        fs = s3fs.S3FileSystem(endpoint_url=moto.endpoint)
        wait_for(lambda: fs.exists(f"{bucket}/run/step-8/manifest.json"), proc, log)
        proxy.hang() if storage == "hung" else proxy.throttle(0.4)
        time.sleep(0.5)
        signalled = time.monotonic()
        deliver(proc, "every_pid", signal.SIGTERM)
        proc.wait(timeout=300)
        exit_s = time.monotonic() - signalled
    finally:
        kill_tree(proc)
        proxy.stop()
    output = log.read_text()
    uploaded = re.search(r"emergency save of step \d+ committed locally .*\((durable after [\d.]+ s|[^)]*)\)", output)
    return {
        "variant": f"grace-{storage}",
        "signal_to_exit_s": exit_s,
        "code": proc.returncode,
        "upload": uploaded.group(1) if uploaded else "?",
        "forced": "forcing exit" in output,
    }


def main() -> None:
    p = parser(__doc__, size_gb=None, repeats=1)
    args = parse(p)
    if not netns.available():
        sys.exit("bench_stalls needs root and iproute2 (network namespaces)")
    os.environ.update(S3_ENV)
    rows: list[dict[str, Any]] = []
    moto = MotoServer().start()
    try:
        for turn in range(args.repeats):
            with scratch(args.dir, "bench-stalls") as out:
                rows.append(partition_once(out) | {"turn": turn})
            for storage in ("throttled", "hung"):
                with scratch(args.dir, "bench-stalls") as out:
                    rows.append(grace_once(out, storage, moto) | {"turn": turn})
    finally:
        moto.stop()
    for row in rows:
        emit(row)
    print(machine())
    parts = [r for r in rows if r["variant"] == "partition"]
    keys = ["declared_s", "survivor_commit_s", "node_0_rank_out_s", "node_1_exit_s", "replacement_to_first_step_s"]
    print(markdown_table(["turn", *keys], [[r["turn"], *(f"{r[k]:.1f}" for k in keys)] for r in parts]))
    graces = [r for r in rows if r["variant"] != "partition"]
    print(
        markdown_table(
            ["variant", "turn", "signal to exit (s)", "code", "upload", "forced exit"],
            [
                [r["variant"], r["turn"], f"{r['signal_to_exit_s']:.1f}", r["code"], r["upload"], r["forced"]]
                for r in graces
            ],
        )
    )


if __name__ == "__main__":
    main()
