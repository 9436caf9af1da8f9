"""Launching real multi-process jobs and a real S3-protocol server for the tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resilience.storage.tiers import Tier

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def start_ranks(
    script: str | Path,
    args: Sequence[str],
    world_size: int,
    *,
    env: dict[str, str] | None = None,
    output_dir: Path | None = None,
) -> list[subprocess.Popen[str]]:
    """Start ``world_size`` processes of ``script`` as ranks of one gloo job, each in its own process group.

    Output goes to a pipe, or with ``output_dir`` to ``rank-<R>.out`` files there: a supervisor that polls
    instead of reading could otherwise block a chatty rank on a full pipe.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = base_env(env)
        rank_env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        with contextlib.ExitStack() as files:
            sink: int | IO[str] = subprocess.PIPE
            if output_dir is not None:
                sink = files.enter_context(open(output_dir / f"rank-{rank}.out", "w"))  # the child keeps a copy
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env=rank_env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
    return procs


def run_ranks(
    script: str | Path,
    args: Sequence[str],
    world_size: int,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run ``world_size`` ranks of ``script`` and wait for all of them.

    On timeout every rank is killed and the test fails with each rank's output, so a hang is never silent. The
    port :func:`free_port` found can be taken by another process before rank 0 listens on it (tests run in
    parallel): then the ranks are started again on another port, at most twice.
    """
    for _ in range(2):
        results = _run_ranks_once(script, args, world_size, timeout, env)
        if not any(r.returncode != 0 and PORT_TAKEN in r.output for r in results):
            return results
    return _run_ranks_once(script, args, world_size, timeout, env)


PORT_TAKEN = "EADDRINUSE"  # what rank 0's TCPStore says when its port was taken


def _run_ranks_once(
    script: str | Path, args: Sequence[str], world_size: int, timeout: float, env: dict[str, str] | None
) -> list[RankResult]:
    procs = start_ranks(script, args, world_size, env=env)
    deadline = time.monotonic() + timeout
    results = []
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    kill_tree(other)
                outputs = "\n".join(f"--- rank {r}:\n{p.communicate()[0]}" for r, p in enumerate(procs))
                raise AssertionError(f"ranks did not finish within {timeout}s\n{outputs}") from None
            results.append(RankResult(rank, proc.returncode, out))
            if proc.returncode != 0 and PORT_TAKEN in out:  # the others wait for a store that never came up
                return results
    finally:
        for proc in procs:
            kill_tree(proc)
    return results


def check_ranks(results: list[RankResult]) -> list[RankResult]:
    bad = [r for r in results if r.returncode != 0]
    if bad:
        text = "\n".join(f"--- rank {r.rank} exited {r.returncode}:\n{r.output[-6000:]}" for r in results)
        raise AssertionError(f"{len(bad)} rank(s) failed\n{text}")
    return results


def kill_tree(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def kill_job(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a launcher and every worker: torchelastic starts each worker in a session of its own."""
    import psutil

    try:
        family = [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    kill_tree(proc)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def accelerate_launch(script: Path, *args: str, flags: Sequence[str] = ()) -> list[str]:
    """The command of a 2-process ``accelerate launch --multi_gpu`` job on this host (CPU ranks: the scripts make
    ``Accelerator(cpu=True)``), on a free port."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu"]
    command += ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*command, "--main_process_port", str(free_port()), *flags, str(script), *args]


def elastic_node(
    port: int, node: int, rdzv_id: str, nproc: int, script: Path, *args: str, static: bool = False
) -> list[str]:
    """The command of node ``node``'s torchrun agent in a 2-node job on this host, with one restart: a c10d
    rendezvous on ``127.0.0.1:port`` hosted by node 0 (a lost node leaves it 8 s after its last heartbeat, not the
    default 15 s; live ones beat every 1-2 s), or with ``static`` the static one, as ``srun torchrun --node_rank``."""
    if static:
        rendezvous = ["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    else:
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", rdzv_id]
        rendezvous += ["--rdzv_conf", f"is_host={int(node == 0)},keep_alive_interval=1,keep_alive_max_attempt=8"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(nproc)]
    return [*command, *rendezvous, "--max_restarts", "1", str(script), *args]


class MotoServer:
    """moto's S3 server as its own process on 127.0.0.1, so a test can also kill it mid-upload."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> MotoServer:
        import requests

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                requests.get(f"{self.endpoint}/moto-api/", timeout=1)
                return self
            except requests.RequestException:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto server did not start within 30 s")

    def reset(self) -> None:
        import requests

        requests.post(f"{self.endpoint}/moto-api/reset", timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc)
            self.proc.wait()
            self.proc = None


def edit_manifest(step_dir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a committed manifest in place, as a bug or someone with write access to the storage could."""
    path = step_dir / "manifest.json"
    body = json.loads(path.read_bytes())
    edit(body)
    path.write_text(json.dumps(body))


def reseal(step_dir: Path, name: str) -> None:
    """Make the manifest's size and checksum of ``name`` match its bytes now: a tamperer covering their tracks."""
    from resilience.storage.manifest import hash_bytes

    data = (step_dir / name).read_bytes()

    def match(body: dict[str, Any]) -> None:
        entry = next(f for f in body["files"] if f["path"] == name)
        entry["size"], entry["xxh3_64"] = len(data), hash_bytes(data)

    edit_manifest(step_dir, match)


def record_tier_opens(reads: list[tuple[str, str]], patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make every read of a checkpoint's files but its manifest note the file, with where it was read, in
    ``reads``: a tier's ``open`` and ``read_bytes`` (by tier name; a local copy is checked, then read), and a
    peer's memory (``"peer"``). ``patch``: ``monkeypatch.setattr`` in a test, plain ``setattr`` in a worker."""
    from resilience.storage.layout import MANIFEST
    from resilience.storage.peer_copies import PeerCopies
    from resilience.storage.tiers import LocalTier, Tier

    def note(where: str, path: str) -> None:
        if "/step-" in path and os.path.basename(path) != MANIFEST:
            reads.append((where, os.path.basename(path)))

    for cls in (Tier, LocalTier):  # the local tier has an open of its own (it reads past the page cache)
        original = cls.__dict__["open"]

        def opened(self: Tier, path: str, mode: str = "rb", *, _original: Any = original) -> IO[bytes]:
            stream = _original(self, path, mode)  # only files that are there
            if mode == "rb":
                note(self.name, path)
            return stream

        patch(cls, "open", opened)
    read_bytes = Tier.read_bytes

    def read_whole(self: Tier, path: str) -> bytes:
        data = read_bytes(self, path)
        note(self.name, path)
        return data

    fetch = PeerCopies.fetch

    def fetched(self: PeerCopies, name: str) -> IO[bytes] | None:
        stream = fetch(self, name)
        if stream is not None:
            note("peer", f"/step-{self.step}/{name}")
        return stream

    patch(Tier, "read_bytes", read_whole)
    patch(PeerCopies, "fetch", fetched)


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
