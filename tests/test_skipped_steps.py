"""What resume and ``resilience ls`` say of durable steps they skip: a manifest gone, files missing or short;
against a real S3-protocol server (moto) on 127.0.0.1."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from resilience.cli import main as cli
from tests.test_engine_s3 import manager, saved

RUN = "ckpt-bucket/run"


def test_resume_names_a_newer_durable_step_whose_manifest_is_gone(
    tmp_path: Path, s3: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    fs = s3["fs"]
    saved(tmp_path / "a", s3, [1, 2])
    fs.rm_file(f"{RUN}/step-2/manifest.json")  # type: ignore[attr-defined]
    caplog.set_level(logging.WARNING, logger="resilience")
    with manager(tmp_path / "fresh-node", s3) as m:
        restored = m.load()
    assert restored is not None and restored.step == 1
    lines = [r.getMessage() for r in caplog.records if "no manifest" in r.getMessage()]
    assert len(lines) == 1 and "step 2 (s3://ckpt-bucket/run/step-2: " in lines[0], lines
    assert "manifest.json was deleted" in lines[0] and "resumed from step 1" in lines[0]


@pytest.mark.parametrize("damage", ["missing", "half"])
def test_ls_marks_a_durable_step_whose_files_do_not_match_its_manifest(
    tmp_path: Path, s3: dict[str, object], capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    fs = s3["fs"]
    saved(tmp_path / "a", s3, [1, 2])
    shard = next(p for p in fs.ls(f"{RUN}/step-2") if p.endswith(".distcp"))  # type: ignore[attr-defined]
    if damage == "missing":
        fs.rm_file(shard)  # type: ignore[attr-defined]
    else:
        data = fs.cat_file(shard)  # type: ignore[attr-defined]
        fs.pipe_file(shard, data[: len(data) // 2])  # type: ignore[attr-defined]
    endpoint = f"endpoint_url={s3['server'].endpoint}"  # type: ignore[attr-defined]
    capsys.readouterr()
    assert cli(["ls", str(s3["url"]), "--storage-option", endpoint, "--json"]) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows[1]["status"] == "committed" and rows[1]["problem"] is None
    assert rows[2]["status"] == "damaged", rows[2]
    assert rows[2]["problem"].startswith("file __0_0.distcp is " + ("missing" if damage == "missing" else ""))
    assert cli(["ls", str(s3["url"]), "--storage-option", endpoint]) == 0
    table = capsys.readouterr().out
    assert any(line.split()[:2] == ["2", "damaged"] for line in table.splitlines()), table
