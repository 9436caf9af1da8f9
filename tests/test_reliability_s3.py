"""Object-store faults against moto's server on loopback, through a fault-injecting proxy.

The client library's own retries are turned off (one botocore attempt, one s3fs attempt), so every fault
reaches the engine and the tests see its retries, backoff and commit decisions rather than botocore's.
Most tests persist on a thread of the test process (``persist="thread"``), because the s3fs attribute and the
monkeypatches they set reach only this process's tier; the retry code is the same in a helper process, which the
``500`` case runs through (its events come back to this process's listeners).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilience import CheckpointError, CheckpointManager
from resilience.cli import main as cli
from resilience.storage.tiers import DurableTier
from tests.s3_proxy import FaultProxy
from tests.test_engine_local import make_state
from tests.test_engine_s3 import manager

BACKOFF_S = 0.05
SHORT_READ_TIMEOUT_S = 3  # for the slow and lost responses; the proxy holds those for DELAY_S
DELAY_S = 4.0


def client_options(endpoint: str, read_timeout: float = 10) -> dict[str, object]:
    """One botocore attempt per request; generous timeouts, so that only injected faults fail on a busy machine."""
    config = {"retries": {"total_max_attempts": 1}, "connect_timeout": 2, "read_timeout": read_timeout}
    return {"endpoint_url": endpoint, "config_kwargs": config}


@pytest.fixture
def proxied(s3: dict[str, object]) -> Iterator[tuple[dict[str, object], FaultProxy]]:
    """The ``s3`` bucket, reached through a :class:`FaultProxy`; ``s3["fs"]`` still talks to moto directly."""
    server = s3["server"]
    proxy = FaultProxy(server.endpoint).start()  # type: ignore[attr-defined]
    try:
        yield {**s3, "options": client_options(proxy.endpoint)}, proxy
    finally:
        proxy.stop()


def faulty_manager(
    root: Path, s3: dict[str, object], events: list[dict[str, object]], **kw: object
) -> CheckpointManager:
    kw.setdefault("persist", "thread")
    m = manager(root, s3, upload_backoff_s=BACKOFF_S, **kw)
    assert m.durable is not None
    m.durable.fs.retries = 1  # s3fs would otherwise retry throttling and dropped connections itself
    m.add_listener(events.append)
    return m


def remote_names(s3: dict[str, object], step: int) -> list[str]:
    fs = s3["fs"]
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"ckpt-bucket/run/step-{step}", refresh=True))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fault", "times", "engine_retries", "persist"),
    # the HTTP client resends some drops itself; s3fs never retries a 500, so its default retries do not matter
    # in the helper process
    [("500", 3, 3, "process"), ("503", 3, 3, "thread"), ("slow", 1, 1, "thread"), ("drop", 2, None, "thread")],
)
def test_transient_faults_are_retried_with_growing_backoff(
    tmp_path: Path,
    proxied: tuple[dict[str, object], FaultProxy],
    fault: str,
    times: int,
    engine_retries: int | None,
    persist: str,
) -> None:
    s3, proxy = proxied
    events: list[dict[str, object]] = []
    s3 = {**s3, "options": client_options(proxy.endpoint, SHORT_READ_TIMEOUT_S)}
    proxy.inject(fault, match="/step-1/__0_0.distcp", times=times, delay_s=DELAY_S)
    with faulty_manager(tmp_path, s3, events, upload_retries=4, persist=persist) as m:
        m.save(1, make_state(1))
        assert m.wait(durable=True)
    assert [r[2] for r in proxy.injected()] == [fault] * times
    retries = [e for e in events if e["event"] == "upload_retry"]
    assert retries and all(e["file"] == "__0_0.distcp" for e in retries)
    assert engine_retries is None or len(retries) == engine_retries
    assert [e["attempt"] for e in retries] == list(range(1, len(retries) + 1))
    for k, (before, after) in enumerate(itertools.pairwise(retries), start=1):
        # delay k is drawn from [0.5, 1] x backoff x 2^(k-1): the gaps grow at least that fast
        assert after["time"] - before["time"] >= 0.5 * BACKOFF_S * 2 ** (k - 1)  # type: ignore[operator]
    assert "manifest.json" in remote_names(s3, 1)


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_endpoint_gone_mid_upload_leaves_no_remote_commit_and_keeps_the_local_one(
    tmp_path: Path, proxied: tuple[dict[str, object], FaultProxy], monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    s3, proxy = proxied
    original = DurableTier.put_file

    def put_then_lose_the_endpoint(self: DurableTier, local_path: str, path: str, callback: object = None) -> None:
        original(self, local_path, path, callback)  # type: ignore[arg-type]
        if "/step-2/" in path:
            proxy.stop()  # connection refused from now on: the first file of step 2 made it, the rest do not

    monkeypatch.setattr(DurableTier, "put_file", put_then_lose_the_endpoint)
    events: list[dict[str, object]] = []
    m = faulty_manager(tmp_path / "a", s3, events, upload_retries=2, upload_concurrency=1, on_upload_error=policy)
    try:
        m.save(1, make_state(1))
        assert m.wait(durable=True)
        handle = m.save(2, make_state(2))
        assert handle is not None and handle.committed.result(60)
        with pytest.raises(
            CheckpointError, match=r"Uploading the checkpoint failed: .*gave up after 3 attempts.*step=2, tier=durable"
        ):
            handle.durable.result(60)
        partial = remote_names(s3, 2)
        assert partial and "manifest.json" not in partial, partial
        assert (tmp_path / "a" / "step-2" / "manifest.json").exists(), "the local commit must stay"
        proxy.start()  # the endpoint is back
        if policy == "raise":  # training stops at its next save, naming the failed upload
            with pytest.raises(CheckpointError, match=r"Uploading the checkpoint failed.*step=2, tier=durable"):
                m.save(3, make_state(3))
        else:  # training went on; the next checkpoint reaches the store again
            m.save(3, make_state(3))
            assert m.wait(durable=True)
    finally:
        m.close()
    endpoint = s3["server"].endpoint  # type: ignore[attr-defined]
    # never committed remotely: "raise" left the partial upload, an unfinished folder and not a checkpoint;
    # "warn" went on to commit step 3, whose retention cleared the older partial one. Either way there is no
    # checkpoint of step 2 to check (3)
    assert cli(["verify", str(s3["url"]), "--storage-option", f"endpoint_url={endpoint}", "--step", "2"]) == 3
    with manager(tmp_path / "fresh-node", s3) as fresh:  # an empty local disk: only what was committed remotely
        restored = fresh.load()
    want = 3 if policy == "warn" else 1
    assert restored is not None and restored.step == want and restored.tier == "durable"
    assert torch.equal(restored.state["model"]["w"], make_state(want)["model"]["w"])


@pytest.mark.parametrize("fault", ["500", "late"])
def test_remote_commit_survives_a_failed_or_lost_manifest_response(
    tmp_path: Path, proxied: tuple[dict[str, object], FaultProxy], fault: str
) -> None:
    """The manifest PUT is retried like any file; one whose response was lost (it landed) counts as done."""
    s3, proxy = proxied
    events: list[dict[str, object]] = []
    s3 = {**s3, "options": client_options(proxy.endpoint, SHORT_READ_TIMEOUT_S)}
    proxy.inject(fault, match="/step-1/manifest.json", delay_s=DELAY_S)
    with faulty_manager(tmp_path, s3, events, upload_retries=2) as m:
        m.save(1, make_state(1))
        assert m.wait(durable=True)
    assert [r[2] for r in proxy.injected()] == [fault]
    assert any(e["event"] == "upload_retry" and e["file"] == "manifest.json" for e in events)
    with manager(tmp_path / "fresh-node", s3) as fresh:
        restored = fresh.load()
    assert restored is not None and restored.step == 1 and restored.tier == "durable"
