"""Pytest plugin that writes one JSON line per test phase to ``$LR_SUITE_RESULTS``, for ``run.py`` to summarise.

Why not ``--junitxml``: Lightning's DDP launcher starts the other ranks by re-running pytest's own command line,
so each rank would write the same XML file and the last one to finish wins. Here only the launching process
(``LOCAL_RANK`` unset or ``0`` when pytest starts) writes, and it appends rather than overwrites.
"""

from __future__ import annotations

import json
import os

import pytest

ENV_RESULTS = "LR_SUITE_RESULTS"
_is_child_rank = False


def pytest_configure(config: pytest.Config) -> None:
    global _is_child_rank
    _is_child_rank = os.environ.get("LOCAL_RANK", "0") != "0"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(ENV_RESULTS)
    if not path or _is_child_rank:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, reason)
        message = str(report.longrepr[2])
    else:
        message = crash.message if crash is not None else (report.longreprtext.strip().splitlines() or [""])[-1]
    text = report.longreprtext if report.failed else ""
    # The first ">" line is where the test function itself failed (pytest shows that frame first).
    test_line = next((line[1:].strip() for line in text.splitlines() if line.startswith(">")), "")
    entry = {
        "id": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "xfail": hasattr(report, "wasxfail"),
        "duration": round(report.duration, 2),
        "message": message,
        "test_line": test_line,
        "text": text if len(text) <= 8000 else text[:4000] + "\n[...]\n" + text[-4000:],
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
