"""Launching real multi-process jobs and a real S3-protocol server for the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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


def run_ranks(
    script: str | Path,
    args: Sequence[str],
    world_size: int,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Start ``world_size`` processes of ``script`` as ranks of one gloo job and wait for all of them.

    On timeout every rank is killed and the test fails with each rank's output, so a hang is never silent.
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
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                kill_tree(other)
            outputs = "\n".join(f"--- rank {r}:\n{p.communicate()[0]}" for r, p in enumerate(procs))
            raise AssertionError(f"ranks did not finish within {timeout}s\n{outputs}") from None
        results.append(RankResult(rank, proc.returncode, out))
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


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
