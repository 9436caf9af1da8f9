"""A stop ends within its grace, whatever storage does: schedulers send SIGKILL when the grace is over (SLURM's
KillWait, Kubernetes' terminationGracePeriodSeconds, 30 s by default), and a job killed so exits 137, which a
requeue-on-75 recipe does not requeue.

A real 2-rank Lightning job uploads to a real S3-protocol server (moto) through a proxy; once its uploads are
flowing, the proxy stops answering PUTs (a hung storage gateway) and SIGTERM reaches every process of the job, as
SLURM delivers it. The emergency step is committed locally, the upload gets what the grace leaves, and every
process is gone by the end of the grace, with the requeue code.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from resilience.cli import main as resilience_cli
from tests.s3_proxy import FaultProxy
from tests.test_preemption_delivery import (
    AGREED,
    assert_none_left,
    deliver,
    kill_job,
    start_lightning,
    wait_for,
)

GRACE_S = 8.0


# throttled: the upload ends within the grace, its 503s retried (the retries run by default in test_throttling.py
# and test_reliability_s3.py)
@pytest.mark.parametrize("storage", ["never_answers", pytest.param("throttles", marks=pytest.mark.slow)])
def test_a_stop_leaves_within_its_grace_when_the_durable_tier_does_not_take_the_upload(
    tmp_path: Path, s3: dict[str, object], storage: str
) -> None:
    fs = s3["fs"]
    proxy = FaultProxy(s3["server"].endpoint).start()  # type: ignore[attr-defined]
    env = {"TEST_STORAGE_OPTIONS": json.dumps({"endpoint_url": proxy.endpoint})}
    args = ["--durable", str(s3["url"]), "--grace", str(GRACE_S), "--step-sleep", "0.3", "--max-steps", "400"]
    proc, log = start_lightning(tmp_path, *args, env=env)
    try:
        durable = f"{str(s3['url']).removeprefix('s3://')}/step-8/manifest.json"
        wait_for(lambda: fs.exists(durable), proc, log)  # type: ignore[attr-defined]
        if storage == "never_answers":  # a hung gateway: connections accepted, nothing answered
            proxy.hang()
        else:  # S3 answers 40% of PUTs with 503 SlowDown, which the client retries
            proxy.throttle(0.4)
        time.sleep(0.5)
        pids = deliver(proc, "every_pid", signal.SIGTERM)
        proc.wait(timeout=GRACE_S + 30)  # the old code never left with a hung gateway: this wait timed out
    finally:
        kill_job(proc)
        proxy.stop()
    output = log.read_text()
    assert proc.returncode == 75, output[-6000:]
    agreed = {int(step) for _, step in AGREED.findall(output)}
    assert len(agreed) == 1, output[-6000:]
    step = agreed.pop()
    assert output.count(f"emergency save of step {step} committed locally") == 2, output[-6000:]
    assert resilience_cli(["verify", str(tmp_path / "ckpt"), "--step", str(step)]) == 0
    if storage == "never_answers":  # the step is the local tier's alone, for the next start to upload
        uploaded = f"{str(s3['url']).removeprefix('s3://')}/step-{step}/manifest.json"
        assert not fs.exists(uploaded), output[-6000:]  # type: ignore[attr-defined]
        assert "forcing exit 75" in output, output[-6000:]
    after_the_decision = output[output.index("all ranks save step") :]
    assert "fault (hang)" not in after_the_decision, output[-6000:]  # the stop's own waiting is no hang
    assert_none_left(pids)
