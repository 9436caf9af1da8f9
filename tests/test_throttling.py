"""A store that throttles: the S3 client's own retries counted in the metrics, the ledger and the report; and the
proxy that throttles or hangs, switched at run time. Against moto's server, through :class:`FaultProxy`."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilience import CheckpointConfig, CheckpointManager
from resilience.cli import main as cli
from resilience.goodput import CheckpointTelemetry, GoodputLedger
from tests.s3_proxy import FaultProxy
from tests.test_engine_local import make_state


@pytest.fixture
def proxy(s3: dict[str, object]) -> Iterator[FaultProxy]:
    started = FaultProxy(s3["server"].endpoint).start()  # type: ignore[attr-defined]
    try:
        yield started
    finally:
        started.stop()


def test_throttling_absorbed_by_the_client_shows_in_metrics_ledger_and_report(
    tmp_path: Path, s3: dict[str, object], proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy.throttle(0.4, match="/step-", seed=3)  # 503 SlowDown to 2 in 5 of the checkpoints' PUTs
    run_dir = tmp_path / "run"
    ledger = GoodputLedger(run_dir)
    telemetry = CheckpointTelemetry(ledger=ledger, sample_gpu=False)
    config = CheckpointConfig(
        run_dir / "ckpt",
        durable_url=str(s3["url"]),
        storage_options={"endpoint_url": proxy.endpoint},  # the client's own retries, as a user has them
        persist="process",  # the uploads run in a helper process: the count comes back with its events
    )
    with CheckpointManager(config, listeners=[telemetry]) as m:
        ledger.startup_done()
        for step in (1, 2, 3):
            m.save(step, make_state(step))
            assert m.wait(durable=True)
            ledger.step_end(step)
    ledger.end()
    throttled = proxy.count("503")
    assert throttled > 0
    assert telemetry.counts["storage_retries"] == throttled
    assert telemetry.counts["upload_retries"] == 0, "the client absorbed every 503: the pack retried nothing"
    shown = [m["checkpoint/storage_retries"] for m in telemetry.drain() if "checkpoint/storage_retries" in m]
    assert shown and shown[-1] == throttled
    capsys.readouterr()
    assert cli(["report", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["retries"] == {"storage": throttled, "upload": 0}
    assert cli(["report", str(run_dir)]) == 0
    assert f"{throttled} by the storage client, 0 by the pack" in capsys.readouterr().out


def test_the_proxy_hangs_connections_and_is_switched_back_at_run_time(s3: dict[str, object], proxy: FaultProxy) -> None:
    import s3fs

    proxy.hang()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as held:
        held.sendall(b"GET /ckpt-bucket HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        deadline = time.monotonic() + 60
        while proxy.count("hang") < 1:
            assert time.monotonic() < deadline, "the proxy never took the connection"
            time.sleep(0.05)
        proxy.passthrough()
        assert held.recv(1) == b"", "a held connection is closed unanswered"
    fs = s3fs.S3FileSystem(
        endpoint_url=proxy.endpoint, skip_instance_cache=True, config_kwargs={"retries": {"total_max_attempts": 1}}
    )
    fs.retries = 1
    fs.pipe_file("ckpt-bucket/forwarded", b"ok")  # forwarded again
    assert s3["fs"].cat_file("ckpt-bucket/forwarded") == b"ok"  # type: ignore[attr-defined]
    proxy.throttle(1.0)
    with pytest.raises(OSError, match=r"SlowDown|reduce your request rate"):
        fs.pipe_file("ckpt-bucket/throttled", b"no")
    assert proxy.count("503") == 1 and proxy.count("hang") == 1
