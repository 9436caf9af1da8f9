"""The adapters' ``Args:`` sections, written in their sources as rendered from the engine configs
(resilience.docstrings), document every argument, and the readers of ``__doc__`` (jsonargparse, so LightningCLI's
``--help``) see them."""

from __future__ import annotations

import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from accelerate_resilience import ResiliencePlugin
from lightning_resilience import (
    AutoResume,
    GoodputMonitor,
    HealthGuardCallback,
    PeriodicCheckpoint,
    ResilientCheckpointIO,
)
from resilience.config import CheckpointConfig
from resilience.docstrings import args_doc, field_docs, parameters, render_args, written_section
from resilience.recovery.peer_loss import PeerLossConfig

# The strategies take Lightning's own strategies' arguments (documented by Lightning), and ResilienceHandle is
# made by attach(); these are the classes users configure the pack with.
ADAPTER_CLASSES = [ResilientCheckpointIO, HealthGuardCallback, PeriodicCheckpoint, GoodputMonitor, AutoResume]
RENDER = Path(__file__).resolve().parent.parent / "tools" / "render_docstrings.py"


def rendered_classes() -> list[type]:
    """The classes tools/render_docstrings.py writes the sections of (its list, not a copy of it)."""
    spec = importlib.util.spec_from_file_location("render_docstrings", RENDER)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return list(tool.ADAPTERS)


def test_every_class_with_a_rendered_section_is_in_the_tool() -> None:
    recorded = [cls for cls in [*ADAPTER_CLASSES, ResiliencePlugin] if "__args_doc__" in cls.__dict__]
    assert recorded and set(recorded) == set(rendered_classes())


@pytest.mark.parametrize("cls", [*ADAPTER_CLASSES, ResiliencePlugin], ids=lambda cls: cls.__name__)
def test_every_argument_is_documented(cls: type) -> None:
    documented = field_docs(cls)
    missing = [name for name in parameters(cls) if len(documented.get(name, "")) < 10]
    assert parameters(cls) and not missing, f"{cls.__name__}.__doc__ does not document {missing}"


@pytest.mark.parametrize("cls", rendered_classes(), ids=lambda cls: cls.__name__)
def test_the_written_section_is_the_rendered_one(cls: type) -> None:
    rendered = args_doc(cls).render(cls)
    assert written_section(cls) == rendered, (
        f"{cls.__name__}'s Args section differs from the engine configs' texts: run python tools/render_docstrings.py"
    )


def test_texts_come_from_the_engine_and_the_adapter() -> None:
    keep_last = field_docs(CheckpointConfig)["keep_last"]
    assert field_docs(ResilientCheckpointIO)["keep_last"] == keep_last
    assert field_docs(ResiliencePlugin)["keep_last"].startswith(keep_last)  # then the plugin's own default
    # both adapters take the engine's name for the same setting, with the engine's text
    assert field_docs(ResiliencePlugin)["local_root"].startswith(field_docs(ResilientCheckpointIO)["local_root"][:80])
    # a renamed field: the engine's text, under the plugin's name
    assert field_docs(ResiliencePlugin)["survivor_saves"].startswith(field_docs(PeerLossConfig)["enabled"])
    assert "Default: 25." in field_docs(ResiliencePlugin)["grace_s"]
    assert "Default:" not in field_docs(HealthGuardCallback)["grace_s"]  # its signature shows it


def test_an_undocumented_argument_fails_the_render() -> None:
    @dataclass
    class Config:
        """Engine settings.

        Attributes:
            size: How many.
        """

        size: int = 1

    class Adapter:
        def __init__(self, size: int = 1, colour: str = "red") -> None:
            pass

    with pytest.raises(ValueError, match=r"Adapter\(colour=\.\.\.\) is documented nowhere"):
        render_args(Adapter, (Config,))
    section = render_args(Adapter, (Config,), own={"colour": "The colour."})
    assert section.splitlines() == ["Args:", "    size: How many.", "    colour: The colour."]
    with pytest.raises(ValueError, match="documents shape, which it does not take"):
        render_args(Adapter, (Config,), own={"colour": "The colour.", "shape": "The shape."})


def test_jsonargparse_reads_the_rendered_docs() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(ResilientCheckpointIO, "io")
    parser.add_class_arguments(HealthGuardCallback, "health")
    text = " ".join(parser.format_help().split())
    assert "How many newest committed checkpoints each tier keeps" in text  # CheckpointConfig's keep_last
    assert "Steps shorter than this many seconds are never a hang" in text  # HealthConfig's hang_min_s
    assert re.search(r"sync_names_below_mb .*A checkpoint with less tensor data", text)


def test_the_class_text_stays() -> None:
    doc = inspect.getdoc(ResilientCheckpointIO) or ""
    assert doc.startswith("Saves Lightning checkpoints asynchronously") and "\nArgs:\n" in doc
