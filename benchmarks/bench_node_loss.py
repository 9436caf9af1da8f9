"""A node lost whole: time from the loss to the first step, restored from its peers against the durable tier.

Two torchrun agents on this host are two nodes, each with its own local root (node-local disks), one rank each,
and a durable tier on moto's S3 server (its own process on 127.0.0.1). The ranks save step 1 of a replicated
state of --size-gb (DCP writes half on each node) and wait for its durable commit; then node b is lost whole:
its agent, its rank and its peer-copy server SIGKILLed, its local root deleted. A new agent with an empty root
joins at once, torchrun restarts node a's rank, and both load step 1 (checked bit-exact) and run one step's
all-reduce. Two variants, in turns that alternate:

- ``peers``: ``peer_copies=True`` (the default): the new node reads node b's files from node a's memory and
  node a's from node a's disk, both through node a's server; node a reads its own from its disk.
- ``durable``: ``peer_copies=False``: the new node reads every file from S3, node a reads node b's from S3.
- ``launch``: as ``peers``, under ``resilience launch --node-wait-s``: node a's launcher finds node b lost by its
  heartbeat, node a's rank runs its script again in its process, and a new launcher with ``--node-rank 1`` joins.

Measured: from the kill to the first step done on both ranks, and the load alone (the slower rank's).

    .venv/bin/python -m benchmarks.bench_node_loss [--size-gb 0.17] [--repeats 2]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    GB,
    column,
    emit,
    loadavg,
    machine,
    markdown_table,
    parse,
    parser,
    rotated,
    scratch,
    worker_env,
)
from tests.helpers import S3_ENV, MotoServer, elastic_node, free_port, kill_job

WORKER = Path(__file__).with_name("node_loss_worker.py")
BUCKET = "bench-node-loss"
TIMEOUT_S = 900
VARIANTS = ("peers", "durable", "launch")


def agent(
    tmp: Path, root: Path, env: dict[str, str], port: int, node: int, size: int, url: str, launch: bool
) -> subprocess.Popen[str]:
    """One node's launcher (node 0's hosts the rendezvous), its rank running the worker: a torchrun agent, or with
    ``launch`` ``resilience launch``, which waits for a lost node's replacement."""
    args = [str(root), url, str(tmp / "out"), str(size)]
    if launch:
        flags = ["--nnodes=2", f"--node-rank={node}", f"--rdzv-endpoint=127.0.0.1:{port}", "--node-wait-s=300"]
        command = [sys.executable, "-m", "resilience.cli", "launch", *flags, "--recovery-timeout-s=300", str(WORKER)]
        command += args
    else:
        command = elastic_node(port, node, "bench-node-loss", 1, WORKER, *args)
    with (tmp / f"agent-{root.name}.log").open("a") as log:
        return subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )


def wait_until(done: Any, what: str, procs: list[subprocess.Popen[str]], tmp: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            logs = "\n".join(p.read_text()[-3000:] for p in tmp.glob("agent-*.log"))
            raise RuntimeError(f"{what} did not happen\n{logs}")
        time.sleep(0.05)


def one_loss(tmp: Path, variant: str, size: int, moto: MotoServer) -> dict[str, float]:
    """One job, one node lost; the seconds from the kill to the first step, and of the slower load."""
    import s3fs

    (tmp / "out").mkdir(parents=True)
    options = {"endpoint_url": moto.endpoint}
    s3fs.S3FileSystem(**options).mkdir(BUCKET)
    env = worker_env(
        {
            **S3_ENV,
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "BENCH_PEER_COPIES": "0" if variant == "durable" else "1",
            "BENCH_STORAGE_OPTIONS": json.dumps(options),
        }
    )
    url = f"s3://{BUCKET}/{tmp.name}"
    port, roots = free_port(), [tmp / "node-a", tmp / "node-b", tmp / "node-new"]
    launch = variant == "launch"
    agents = [agent(tmp, roots[n], env, port, n, size, url, launch) for n in (0, 1)]
    try:
        out = tmp / "out"
        wait_until(lambda: len(list(out.glob("saved-*"))) == 2, "the durable commit", agents, tmp)
        if variant != "durable":
            wait_for_copy(roots[0])
        server = peer_server_pid(roots[1])
        kill_job(agents[1])
        if server is not None:
            os.kill(server, signal.SIGKILL)
        shutil.rmtree(roots[1])
        lost = time.time()
        agents.append(agent(tmp, roots[2], env, port, 1, size, url, launch))
        wait_until(lambda: len(list(out.glob("*.json"))) == 2, "the resume", [agents[0], agents[2]], tmp)
        reports = [json.loads(p.read_text()) for p in out.glob("*.json")]
    finally:
        for proc in agents:
            kill_job(proc)
    assert all(r["exact"] and r["restored"] == 1 for r in reports), reports
    new = next(r for r in reports if r["root"] == str(roots[2]))
    read = {k[5:-6]: v for k, v in new["timings"].items() if k.startswith("from_")}
    emit({"variant": variant, "reports": reports})
    return {
        "to_first_step_s": max(r["first_step"] for r in reports) - lost,
        "load_s": max(r["loaded"] - r["load_began"] for r in reports),
        "new_node_from_s3_mb": read.get("durable", 0.0) / 1e6,
    }


def peer_server_pid(root: Path) -> int | None:
    try:
        return int(json.loads((root / ".peer" / "server.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def wait_for_copy(root: Path) -> None:
    """Until node a's server holds node b's files (sent after the durable commit, in the background)."""
    from resilience.storage.peer_copies import held

    where = json.loads((root / ".peer" / "server.json").read_text())
    manifest = json.loads((root / "step-1" / "manifest.json").read_text())
    deadline = time.monotonic() + TIMEOUT_S
    while not any(c["rank"] is not None for c in held((where["host"], where["port"]), manifest["run_id"])):
        if time.monotonic() > deadline:
            raise RuntimeError("node b's files never reached node a's server")
        time.sleep(0.05)


def main() -> None:
    args = parse(parser(__doc__, size_gb=0.17, repeats=2))
    os.environ.update(S3_ENV)  # moto's fake credentials, for this process's s3fs too
    size = int(args.size_gb * GB)
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with scratch(args.dir, "node-loss") as tmp:
        for turn in range(args.repeats):
            for variant in rotated(VARIANTS, turn):
                moto = MotoServer().start()  # a fresh one each time: moto keeps every object in its memory
                try:
                    samples[variant].append(one_loss(tmp / f"{turn}-{variant}", variant, size, moto))
                finally:
                    moto.stop()
                print(variant, samples[variant][-1], flush=True)
    rows = []
    for variant in VARIANTS:
        first, load = column(samples[variant], "to_first_step_s"), column(samples[variant], "load_s")
        s3 = column(samples[variant], "new_node_from_s3_mb")
        rows.append((variant, first.fmt(1), load.fmt(1), f"{s3.median:.0f}"))
    print(f"\n{machine()}; load average {loadavg()}; {args.size_gb} GB state, {args.repeats} rounds\n")
    print(markdown_table(("variant", "loss to first step, s", "load, s", "new node read from S3, MB"), rows))


if __name__ == "__main__":
    main()
