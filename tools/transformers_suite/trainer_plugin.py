"""Pytest plugin (``-p trainer_plugin``): every Hugging Face Trainer gets ``attach_trainer()`` once it is made.

That is where docs/TRANSFORMERS.md puts the call. The pack's checkpoints, and its goodput ledger, go to a folder
per test and output directory under ``$LA_SUITE_IO_BASE``, not into the output directory itself: the Trainer's
tests count what their output directory holds. Two Trainers of one test on the same output directory share the
folder, as two runs of one job do. A Trainer the pack refuses (``push_to_hub``, ``save_only_model``, DeepSpeed)
goes on without it. One JSON line per Trainer goes to ``$LA_SUITE_RECORD``: the test, and where its checkpoints
go or why it has none.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

import pytest

# the Accelerate plugin's record of each attach, and its test id (the runner puts that plugin's folder on the path)
from attach_plugin import _record, _test
from transformers import Trainer

from accelerate_resilience import ResiliencePlugin
from accelerate_resilience.transformers import attach_trainer

_init = Trainer.__init__


def _folder(output_dir: str) -> str:
    """The pack's folder for this test and output directory."""
    test = re.sub(r"[^A-Za-z0-9_.-]+", "_", _test["id"])[-100:]
    key = hashlib.sha1(os.path.realpath(output_dir).encode()).hexdigest()[:10]
    return os.path.join(os.environ["LA_SUITE_IO_BASE"], test, key)


def _init_and_attach(self: Trainer, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    folder = _folder(str(self.args.output_dir))
    plugin = ResiliencePlugin(local_root=os.path.join(folder, "resilience"), run_dir=folder, persist="thread")
    try:
        attach_trainer(self, plugin)
    except Exception as exc:  # a Trainer the pack refuses: the test goes on without it
        _record(attached=False, why=f"{type(exc).__name__}: {exc}")
    else:
        _record(attached=True, local_root=plugin.local_root)


def pytest_configure(config: pytest.Config) -> None:
    Trainer.__init__ = _init_and_attach  # type: ignore[method-assign]


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _test["id"] = nodeid  # before setUp, which may make a Trainer too
