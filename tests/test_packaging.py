"""What the distribution states about itself holds: the floors that ``make test-floors`` pins are the ones
pyproject.toml states, the packages are marked typed, and the example LightningCLI config builds the pack (the
jsonargparse floor is where that broke)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT

tomllib = pytest.importorskip("tomllib")

# Stated floors the smoke run does not install: torch stays at the CPU wheel on disk, gcsfs has no emulator here,
# and the linters do not run there.
NOT_PINNED = {"torch", "gcsfs", "ruff", "mypy"}
HELPER_PINS = {"boto3", "aiobotocore"}  # pinned only so that pip resolves quickly (see requirements/floors.txt)


def stated_floors() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines.extend(extra)
    floors: dict[str, str] = {}
    for line in lines:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name == "training-resilience":
            continue
        lows = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert len(lows) == 1, f"{line!r} states no single floor (>=)"
        assert floors.get(name, lows[0]) == lows[0], f"{name} has two floors"
        floors[name] = lows[0]
    return floors


def pinned() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "requirements" / "floors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9.]+)", line).groups()  # type: ignore[union-attr]
            pins[canonicalize_name(name)] = version
    return pins


def test_every_stated_floor_is_pinned_by_the_floors_run_and_nothing_else() -> None:
    floors, pins = stated_floors(), pinned()
    assert {name: floors[name] for name in floors if name not in NOT_PINNED} == {
        name: pins[name] for name in pins if name not in HELPER_PINS
    }


def test_the_packages_are_marked_typed() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["package-data"]["*"] == ["py.typed"]
    for package in ("resilience", "lightning_resilience", "accelerate_resilience"):
        assert (ROOT / package / "py.typed").is_file(), package


def test_the_example_lightning_cli_config_builds_the_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    from examples.demo_model import DemoData, DemoModel
    from lightning_resilience import AutoResume, ResilientCheckpointIO, ResilientDDPStrategy
    from resilience.persist.fork_server import SHARE_VARIABLE

    monkeypatch.chdir(tmp_path)  # the config's paths are relative to where it runs
    # its 2 devices make the strategy share this process's fork server with the ranks Lightning would start:
    # through this variable, unset again after (later tests' processes are nobody's ranks)
    monkeypatch.setenv(SHARE_VARIABLE, "")
    cli = LightningCLI(DemoModel, DemoData, run=False, args=["--config", str(ROOT / "examples" / "lightning_cli.yaml")])
    assert isinstance(cli.trainer.strategy, ResilientDDPStrategy)
    assert isinstance(cli.trainer.strategy.checkpoint_io, ResilientCheckpointIO)
    assert any(isinstance(callback, AutoResume) for callback in cli.trainer.callbacks)
