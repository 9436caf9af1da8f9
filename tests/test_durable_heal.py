"""The durable tier healed at a resume: this run's local steps it lost or holds damaged uploaded again, in the
background, under the lease; against a real S3-protocol server (moto) on 127.0.0.1."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from resilience.errors import CorruptCheckpointError
from resilience.persist.heal import HealSettings, heal
from resilience.storage import catalog
from resilience.storage.lease import Lease
from resilience.storage.owners import Owner
from resilience.storage.tiers import DurableTier, LocalTier
from tests.test_engine_local import make_state
from tests.test_engine_s3 import hold_uploads, manager, saved

RUN = "ckpt-bucket/run"


def eventually(check: Callable[[], bool], what: str) -> None:
    """Wait for background work to show in storage (generous: the machine may be busy)."""
    deadline = time.monotonic() + 120
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def exists(s3: dict[str, object], path: str) -> bool:
    """Whether the object is there now (s3fs remembers listings: this process's tiers share its instance)."""
    s3["fs"].invalidate_cache()  # type: ignore[attr-defined]
    return bool(s3["fs"].exists(path))  # type: ignore[attr-defined]


def committed_and_whole(s3: dict[str, object], step: int) -> bool:
    """The durable step is committed and every file matches its manifest (checksums of all)."""
    s3["fs"].invalidate_cache()  # type: ignore[attr-defined]
    tier = DurableTier(str(s3["url"]), s3["options"])  # type: ignore[arg-type]
    entry = next((e for e in catalog.scan(tier) if e.step == step), None)
    if entry is None or not entry.committed:
        return False
    try:
        catalog.verify(entry, full=True)
    except CorruptCheckpointError:
        return False
    return True


def test_a_resumed_run_uploads_again_the_local_steps_the_durable_tier_lost_or_holds_damaged(
    tmp_path: Path, s3: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    fs = s3["fs"]
    saved(tmp_path / "a", s3, [1, 2, 3])
    fs.rm(f"{RUN}/step-1", recursive=True)  # type: ignore[attr-defined]  # a lifecycle rule took it whole
    fs.rm_file(f"{RUN}/step-2/manifest.json")  # type: ignore[attr-defined]  # a person deleted a manifest
    shard = next(p for p in fs.ls(f"{RUN}/step-3") if p.endswith(".distcp"))  # type: ignore[attr-defined]
    fs.pipe_file(shard, fs.cat_file(shard)[:100])  # type: ignore[attr-defined]  # an upload cut short
    caplog.set_level(logging.INFO, logger="resilience")
    with manager(tmp_path / "a", s3, keep_last=3) as m:
        restored = m.load()
        assert restored is not None and (restored.step, restored.tier) == (3, "local")
        m.claim(resumed_from=3)
        for step in (1, 2, 3):
            eventually(lambda step=step: committed_and_whole(s3, step), f"step {step} healed")
    line = next(r.getMessage() for r in caplog.records if "lacks this run's step(s)" in r.getMessage())
    assert "3 (file __0_0.distcp is 100 bytes" in line and "2 (no manifest)" in line and "1 (no copy)" in line
    with manager(tmp_path / "fresh-node", s3) as fresh:  # an empty disk: the durable tier alone serves it
        again = fresh.load()
    assert again is not None and (again.step, again.tier) == (3, "durable")
    assert torch.equal(again.state["model"]["w"], make_state(3)["model"]["w"])


def test_healing_runs_in_the_background_retention_leaves_it_and_close_finishes_its_step(
    tmp_path: Path, s3: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = s3["fs"]
    saved(tmp_path / "a", s3, [1, 2])
    fs.rm(f"{RUN}/step-1", recursive=True)  # type: ignore[attr-defined]
    gate = hold_uploads(monkeypatch, "/step-1/")
    m = manager(tmp_path / "a", s3, keep_last=3, persist="thread")
    try:
        m.load()
        m.claim(resumed_from=2)  # returns while the healing's upload is held: it never delays training
        eventually(lambda: exists(s3, f"{RUN}/step-1/.writer.json"), "the healing began")
        assert not exists(s3, f"{RUN}/step-1/manifest.json")
        m.save(3, make_state(3))  # its durable commit applies retention: older uncommitted folders of the run go
        assert m.wait(durable=True)
        assert exists(s3, f"{RUN}/step-1/.writer.json"), "retention deleted the healing's upload"
        healer = m._roots._healer
        assert healer is not None

        def release() -> None:  # once close() told the healing to stop, and a while after: close() waits for it
            healer._stopped.wait(120)
            time.sleep(0.5)
            gate.set()

        threading.Thread(target=release, daemon=True).start()
        m.close()
        assert committed_and_whole(s3, 1), "close() returned before the step in flight was healed"
    finally:
        gate.set()
        m.close()


def test_healing_leaves_another_runs_step_and_stops_without_the_lease(
    tmp_path: Path, s3: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    fs = s3["fs"]
    theirs = saved(tmp_path / "theirs", s3, [2])  # another run's step 2 in the durable tier, damaged since
    shard = next(p for p in fs.ls(f"{RUN}/step-2") if p.endswith(".distcp"))  # type: ignore[attr-defined]
    fs.pipe_file(shard, b"short")  # type: ignore[attr-defined]
    before = fs.cat_file(f"{RUN}/step-2/manifest.json")  # type: ignore[attr-defined]
    fs.rm(f"{RUN}/.lease", recursive=True)  # type: ignore[attr-defined]
    with manager(tmp_path / "ours", {**s3, "url": f"s3://{RUN}-elsewhere"}, keep_last=3) as m:
        for step in (1, 2):
            m.save(step, make_state(step))
            assert m.wait(durable=True)
        assert m.run_id is not None and m.run_id != theirs
        ours = m.run_id
    local = LocalTier(tmp_path / "ours")
    durable = DurableTier(str(s3["url"]), s3["options"])  # type: ignore[arg-type]
    me = Owner.me(ours)
    Lease(durable, me).acquire()
    settings = HealSettings(keep_last=3)
    healed = heal(local, durable, run_id=ours, upto=2, writer=me.to_json(), settings=settings)
    assert healed == [1], "step 1 is ours and missing; step 2 there is another run's"
    assert fs.cat_file(f"{RUN}/step-2/manifest.json") == before  # type: ignore[attr-defined]
    assert fs.cat_file(shard) == b"short"  # type: ignore[attr-defined]  # not ours to replace

    fs.rm(f"{RUN}/step-1", recursive=True)  # type: ignore[attr-defined]
    Lease(durable, Owner.me(ours)).acquire()  # a relaunch of this run takes the URL over at once
    caplog.set_level(logging.WARNING, logger="resilience")
    assert heal(local, durable, run_id=ours, upto=2, writer=me.to_json(), settings=settings) == []
    assert not exists(s3, f"{RUN}/step-1"), "a job that no longer holds the durable URL uploaded"
    assert any("was taken over by another job" in r.getMessage() for r in caplog.records)
