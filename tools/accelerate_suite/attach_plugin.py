"""Pytest plugin (``-p attach_plugin``): every Accelerator gets ``attach()`` after its first ``prepare()``.

That is where the README puts the call. The handle takes ``local_root`` from the Accelerator's
``ProjectConfiguration(project_dir=...)`` when it has one, as a user of automatic checkpoint naming would leave
it; otherwise (or with ``$LA_SUITE_ROOTS=test``) a folder per test under ``$LA_SUITE_IO_BASE``. A test's handles
are closed when it ends (a failed last save fails it), and an Accelerator made later in the same test closes
the earlier ones first, as a restarted process would have. One JSON line per Accelerator goes to
``$LA_SUITE_RECORD``: the test, and where its handle saves or why it has none.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from accelerate import Accelerator

from accelerate_resilience import ResilienceHandle, ResiliencePlugin, attach

_prepare = Accelerator.prepare
_seen: weakref.WeakSet[Accelerator] = weakref.WeakSet()
_handles: list[ResilienceHandle] = []
_test = {"id": ""}


def _record(**entry: Any) -> None:
    path = os.environ.get("LA_SUITE_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": _test["id"], **entry}) + "\n")


def _plugin_for(accelerator: Accelerator) -> ResiliencePlugin:
    if accelerator.project_dir and os.environ.get("LA_SUITE_ROOTS", "project") == "project":
        return ResiliencePlugin()
    folder = re.sub(r"[^A-Za-z0-9_.-]+", "_", _test["id"])[-120:]
    return ResiliencePlugin(local_root=os.path.join(os.environ["LA_SUITE_IO_BASE"], folder))


def _close_all(*, quietly: bool = False) -> None:
    """Close the test's handles (waiting for their last saves); ``quietly``: the test failed already, and its own
    error is the one to report."""
    while _handles:
        handle = _handles.pop(0)
        try:
            handle.close()
        except Exception as exc:
            if not quietly:
                raise
            _record(attached=True, close_failed=f"{type(exc).__name__}: {exc}")


def _prepare_and_attach(self: Accelerator, *args: Any, **kwargs: Any) -> Any:
    prepared = _prepare(self, *args, **kwargs)
    if self not in _seen:
        _seen.add(self)
        _close_all()
        try:
            handle = attach(self, _plugin_for(self))
        except Exception as exc:  # an Accelerator the pack refuses (DeepSpeed, ...): the test goes on without it
            _record(attached=False, why=f"{type(exc).__name__}: {exc}")
        else:
            _handles.append(handle)
            _record(attached=True, local_root=handle.manager.config.local_root)
    return prepared


def pytest_configure(config: pytest.Config) -> None:
    Accelerator.prepare = _prepare_and_attach  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """The handles close as the test's body ends, before pytest reports on it: no save of theirs still runs in the
    background while the next test starts (or while pytest formats a failure)."""
    _test["id"] = item.nodeid
    try:
        result = yield
    except BaseException:
        _close_all(quietly=True)
        raise
    _close_all()
    return result
