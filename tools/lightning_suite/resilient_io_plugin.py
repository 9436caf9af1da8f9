"""Pytest plugin that makes every Lightning ``Trainer`` and every ``Fabric`` of a test run save through
``ResilientCheckpointIO``.

Load it with ``-p resilient_io_plugin`` (this directory on ``PYTHONPATH``) to run someone else's tests, such as
Lightning's own ``tests_pytorch/checkpointing`` or Fabric's save and load tests, against the pack without editing
them.

Why ``_AcceleratorConnector.__init__`` (and Fabric's ``_Connector.__init__``): every ``Trainer`` (``Fabric``)
builds exactly one, and it receives ``plugins`` and ``strategy`` exactly as the user passed them, so the plugin
can be added the way a user would add it (``Trainer(plugins=[io])``) and one that already has a CheckpointIO (in
``plugins`` or on a strategy instance) can be left alone. Patching ``Trainer.__init__`` instead would have to
mirror its long signature.

Environment (set by ``run.py``; defaults make plain ``pytest -p resilient_io_plugin`` work too):

- ``LR_SUITE_IO_BASE``: directory under which each test gets ``<slug of the test id>/`` as ``local_root``.
  It is fixed once per session and inherited by the processes Lightning's DDP launcher starts, which re-run
  the same test and so find the same directory. It must lie outside the test tree: Lightning's conftest fails
  tests that leave files there.
- ``LR_SUITE_IO_SCOPE``: ``test`` (default: all Trainers of a test share one ``local_root``, as a script that
  fits and then resumes would) or ``trainer`` (each Trainer its own, as unrelated runs would).
- ``LR_SUITE_RECORD``: a JSON-lines file that gets one line per Trainer or Fabric: test id, strategy, and
  whether (and why not) the plugin was added, so a pass can be told from a test that never used the plugin.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import itertools
import json
import os
import re
import tempfile
from collections.abc import Callable, Generator, Iterable
from typing import Any

import pytest

ENV_BASE = "LR_SUITE_IO_BASE"
ENV_SCOPE = "LR_SUITE_IO_SCOPE"
ENV_RECORD = "LR_SUITE_RECORD"

# DDP strategy names whose pack counterpart saves from every rank. Mapped only when the pack registers the
# name, so the plugin keeps working if the strategy is renamed or dropped (the test then runs on plain DDP).
_DDP_NAMES = {"ddp": "resilient_ddp", "ddp_find_unused_parameters_true": "resilient_ddp_find_unused_parameters_true"}

_created: list[Any] = []  # the IOs made during the current test, closed after its teardown
_counter = itertools.count()


def _current_test() -> str:
    """The running test's id, from the variable pytest itself sets (also seen by DDP child processes)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "outside-a-test")
    return current.rsplit(" (", 1)[0]


def _slug(test_id: str) -> str:
    """A short, unique directory name for a test id (ids hold ``/``, ``[``, ``::`` and can be long)."""
    readable = re.sub(r"[^A-Za-z0-9_.=-]+", "_", test_id.rsplit("/", 1)[-1])[:80]
    return f"{readable}-{hashlib.sha1(test_id.encode()).hexdigest()[:8]}"


def _local_root(test_id: str) -> str:
    root = os.path.join(os.environ[ENV_BASE], _slug(test_id))
    if os.environ.get(ENV_SCOPE, "test") == "trainer":
        root = os.path.join(root, f"trainer-{next(_counter)}")
    return root


def _own_checkpoint_io(plugins: Any, strategy: Any) -> str | None:
    """Why the Trainer keeps its own CheckpointIO, or None when it has none."""
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

    for plugin in _as_list(plugins):
        if isinstance(plugin, CheckpointIO):
            return f"plugins has {type(plugin).__name__}"
    if getattr(strategy, "_checkpoint_io", None) is not None:  # a Strategy instance built with checkpoint_io=
        return f"strategy has {type(strategy._checkpoint_io).__name__}"
    return None


def _as_list(plugins: Any) -> list[Any]:
    """Lightning's own normalisation: None, one plugin, or an iterable of plugins."""
    if plugins is None:
        return []
    return list(plugins) if isinstance(plugins, Iterable) and not isinstance(plugins, str) else [plugins]


def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get(ENV_RECORD)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def _wrap(original: Callable[..., None], registry: Any) -> Callable[..., None]:
    """``original``, the connector's ``__init__``, with the plugin added; ``registry``: its strategy names."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        plugins, strategy = bound.arguments["plugins"], bound.arguments["strategy"]
        test_id = _current_test()
        entry: dict[str, Any] = {"test": test_id, "pid": os.getpid(), "strategy": _describe(strategy)}
        kept = _own_checkpoint_io(plugins, strategy)
        if kept is not None:
            entry.update(injected=False, why=kept)
            _record(entry)
        else:
            if isinstance(strategy, str) and _DDP_NAMES.get(strategy) in registry:
                bound.arguments["strategy"] = _DDP_NAMES[strategy]
                entry["strategy_replaced_by"] = _DDP_NAMES[strategy]
            bound.arguments["plugins"] = [*_as_list(plugins), _new_io(entry)]
        original(*bound.args, **bound.kwargs)

    return __init__


def _new_io(entry: dict[str, Any]) -> Any:
    """A plugin for the running test (recorded with ``entry``), closed after its teardown."""
    from lightning_resilience import ResilientCheckpointIO

    local_root = _local_root(entry["test"])
    io = ResilientCheckpointIO(local_root=local_root)
    _created.append(io)
    entry.update(injected=True, local_root=local_root)
    _record(entry)
    return io


def _default_io(stock: property) -> property:
    """Fabric's ``Strategy.checkpoint_io``, whose default (a strategy made without one, as Fabric's strategy tests
    make them) is the pack's plugin instead of ``TorchCheckpointIO``."""

    def checkpoint_io(self: Any) -> Any:
        if self._checkpoint_io is None:
            entry = {"test": _current_test(), "pid": os.getpid(), "strategy": type(self).__name__}
            self._checkpoint_io = _new_io({**entry, "via": "the strategy's default CheckpointIO"})
        return stock.fget(self)  # type: ignore[misc]

    return property(checkpoint_io, stock.fset)


def _describe(strategy: Any) -> str:
    return strategy if isinstance(strategy, str) else type(strategy).__name__


def pytest_configure(config: pytest.Config) -> None:
    """Fix the session's base directory (before any test, so no test sees it as a leaked variable) and patch."""
    try:  # fail the session once, not every test, when the pack does not import (e.g. mid-refactor)
        import lightning_resilience.fabric  # noqa: F401  # registers Fabric's "resilient_ddp" too
    except Exception as exc:
        raise pytest.UsageError(f"resilient_io_plugin: cannot import lightning_resilience: {exc!r}") from exc
    if not os.environ.get(ENV_BASE):
        os.environ[ENV_BASE] = tempfile.mkdtemp(prefix="lr-suite-io-")
    from lightning.fabric import connector as fabric_connector
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.trainer.connectors import accelerator_connector

    for connector, registry in (
        (accelerator_connector._AcceleratorConnector, StrategyRegistry),
        (fabric_connector._Connector, STRATEGY_REGISTRY),
    ):
        if not getattr(connector.__init__, "_resilient_io_plugin", False):
            patched = _wrap(connector.__init__, registry)
            patched._resilient_io_plugin = True  # type: ignore[attr-defined]
            connector.__init__ = patched  # type: ignore[method-assign]
    from lightning.fabric.strategies.strategy import Strategy

    if not getattr(Strategy.checkpoint_io.fget, "_resilient_io_plugin", False):
        patched_io = _default_io(Strategy.checkpoint_io)
        patched_io.fget._resilient_io_plugin = True  # type: ignore[union-attr]
        Strategy.checkpoint_io = patched_io  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """After the test's own teardown (and its fixtures' checks), close the IOs it made and left open.

    A test that saves outside ``fit`` never reaches ``Strategy.teardown``; closing here keeps its background
    work from running into the next test. Whatever the test itself observed is already reported.
    """
    try:
        return (yield)
    finally:
        while _created:
            with contextlib.suppress(Exception):
                _created.pop().teardown()
