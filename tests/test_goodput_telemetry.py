"""Checkpoint telemetry from a real CheckpointManager: per-save figures, GPU use during the save, ledger notes."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pynvml
import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.goodput import CheckpointTelemetry, GoodputLedger
from resilience.goodput.summary import read_events


class FakeNvml:
    """The pynvml calls the sampler makes, with the module's real error classes."""

    def __init__(self, utilization: float, fail_after: int | None = None) -> None:
        self.utilization = utilization
        self.fail_after = fail_after
        self.calls = 0
        self.handles: list[Any] = []
        self.shut_down = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.handles.append(index)
        return f"gpu{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.handles.append(uuid)
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return type("Utilization", (), {"gpu": self.utilization, "memory": 10})()


def _wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_real_save_and_upload_become_metrics_and_ledger_notes(tmp_path: Path) -> None:
    ledger = GoodputLedger(tmp_path / "run", process_start=time.time())
    nvml = FakeNvml(utilization=73.0)
    telemetry = CheckpointTelemetry(ledger=ledger, nvml=nvml, gpu_every_s=0.01)
    assert telemetry.gpu is not None
    config = CheckpointConfig(tmp_path / "local", durable_url=f"memory://telemetry-{uuid.uuid4().hex}")
    state = {"w": torch.randn(512, 512), "step": 3}
    with CheckpointManager(config, listeners=[telemetry]) as manager:
        handle = manager.save(3, state)
        assert handle is not None and handle.durable.result(60)
    telemetry.close()
    ledger.end()

    saved, uploaded = telemetry.drain()
    assert telemetry.drain() == []
    assert saved["checkpoint/committed_step"] == 3 and saved["checkpoint/bytes"] >= 512 * 512 * 4
    assert saved["checkpoint/block_s"] == pytest.approx(handle.timings["block_s"])
    assert saved["checkpoint/write_s"] > 0
    assert saved["checkpoint/write_MBps"] == pytest.approx(
        saved["checkpoint/bytes"] / saved["checkpoint/write_s"] / 1e6
    )
    assert saved["checkpoint/gpu_util_save_pct"] == 73.0
    assert uploaded["checkpoint/upload_s"] > 0 and uploaded["checkpoint/upload_bytes"] == saved["checkpoint/bytes"]
    assert uploaded["checkpoint/upload_MBps"] > 0
    assert nvml.handles == [0] and nvml.shut_down

    assert ledger.path is not None
    notes = {r["e"]: r for r in read_events(ledger.path)[0]}
    assert notes["save_local_commit"]["step"] == 3 and notes["save_local_commit"]["bytes"] == saved["checkpoint/bytes"]
    assert notes["save_durable_commit"]["upload_s"] == uploaded["checkpoint/upload_s"]


def test_without_a_gpu_the_figures_leave_gpu_use_out(caplog: pytest.LogCaptureFixture) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    with caplog.at_level(logging.DEBUG, logger="resilience.goodput.telemetry"):
        telemetry = CheckpointTelemetry()
    assert telemetry.gpu is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG] and "not sampled" in caplog.records[0].getMessage()
    telemetry({"event": "local_commit", "step": 1, "rank": 0, "time": time.time(), "bytes": 10, "write_s": 1.0})
    (metrics,) = telemetry.drain()
    assert "checkpoint/gpu_util_save_pct" not in metrics and metrics["checkpoint/write_MBps"] == 1e-5


def test_a_lost_gpu_stops_sampling_quietly() -> None:
    nvml = FakeNvml(utilization=50.0, fail_after=2)
    telemetry = CheckpointTelemetry(nvml=nvml, gpu_every_s=0.01)
    assert telemetry.gpu is not None
    _wait_for(lambda: nvml.calls == 3)
    time.sleep(0.05)
    assert nvml.calls == 3  # sampling stopped at the error
    telemetry.close()


def test_visible_devices_map_to_physical_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    nvml = FakeNvml(0.0)
    CheckpointTelemetry(nvml=nvml).close()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    CheckpointTelemetry(nvml=nvml).close()
    assert nvml.handles == [6, "GPU-bbb"]


def test_a_peer_copy_becomes_metrics() -> None:
    telemetry = CheckpointTelemetry(sample_gpu=False)
    telemetry({"event": "peer_copy", "step": 5, "rank": 0, "time": time.time(), "bytes": 2048, "seconds": 0.25})
    assert telemetry.drain() == [{"checkpoint/peer_copy_s": 0.25, "checkpoint/peer_copy_bytes": 2048.0}]


def test_failures_skips_and_retries_are_counted() -> None:
    telemetry = CheckpointTelemetry(sample_gpu=False)
    for kind in ("failed", "upload_retry", "upload_retry", "skipped", "deleted", "peer_copy_failed"):
        telemetry({"event": kind, "step": 5, "rank": 0, "time": time.time()})
    for count in (3, 4):  # the storage client's own retries come as one event per upload, with their count
        telemetry({"event": "storage_retry", "step": 6, "rank": 0, "time": time.time(), "count": count})
    assert telemetry.counts == {
        "failures": 1,
        "skipped": 1,
        "upload_retries": 2,
        "storage_retries": 7,
        "peer_copy_failures": 1,
    }
    drained = telemetry.drain()
    assert [m for m in drained if "checkpoint/upload_retries" in m][-1]["checkpoint/upload_retries"] == 2.0
    assert [m["checkpoint/storage_retries"] for m in drained if "checkpoint/storage_retries" in m] == [3.0, 7.0]
