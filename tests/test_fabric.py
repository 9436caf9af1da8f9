"""The Fabric adapter in one process, with Fabric's own single-device strategy and the plugin alone:
``fabric.save`` becomes an asynchronous committed step and an ordinary file, ``fabric.load`` fills the state in
place from the verified step, ``resume`` takes the newest checkpoint that verifies, and what is not the pack's (a
user's ``torch.save`` file, a dict without an optimizer) stays Fabric's."""

from __future__ import annotations

import gc
import os
import subprocess
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_resilience.fabric import HealthGuardCallback, ResilientCheckpointIO, resume
from resilience.errors import ConfigError
from resilience.persist.fork_server import SHARE_VARIABLE, ForkServer
from tests.test_engine_local import gated_writer


def make_fabric(root: Path, **settings: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[ResilientCheckpointIO(str(root), **settings)])
    fabric.launch()
    return fabric


def training(fabric: Fabric, seed: int = 0) -> dict[str, Any]:
    """A model, its optimizer and a plain value, set up by Fabric, as a Fabric loop keeps them."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    return {"model": model, "optimizer": optimizer, "step": 0}


def train(fabric: Fabric, state: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        fabric.backward(state["model"](torch.randn(3, 4)).sum())
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["step"] += 1


def committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "manifest.json").exists())


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every background write waits until the test opens the gate."""
    opened = gated_writer(monkeypatch)
    yield opened
    opened.set()


def test_fabric_save_returns_before_its_step_is_written_and_the_file_comes_from_the_commit(
    tmp_path: Path, gate: threading.Event
) -> None:
    fabric = make_fabric(tmp_path / "ckpt", sync_names_below_mb=0)
    state = training(fabric)
    resume(fabric, state)  # the line before the loop: from here on the optimizer's steps number the checkpoints
    train(fabric, state, 3)
    fabric.save(tmp_path / "named" / "last.pth", state)
    assert committed(tmp_path / "ckpt") == [] and not (tmp_path / "named" / "last.pth").exists()
    gate.set()
    loaded = training(fabric, seed=1)
    fabric.load(tmp_path / "named" / "last.pth", loaded)  # a load of a name being written waits for it
    assert committed(tmp_path / "ckpt") == [3] and (tmp_path / "named" / "last.pth").is_file()
    assert loaded["step"] == 3 and same_weights(loaded["model"], state["model"])


def test_a_saved_name_is_an_ordinary_file_and_loads_in_place_from_the_verified_step(tmp_path: Path) -> None:
    fabric = make_fabric(tmp_path / "ckpt")
    state = training(fabric)
    resume(fabric, state)
    train(fabric, state, 4)
    path = tmp_path / "named" / "last.pth"
    fabric.save(path, {**state, "note": {"lr": 0.1}})
    assert committed(tmp_path / "ckpt") == [4]
    plain = torch.load(path, weights_only=False)  # what a Fabric without the pack, or torch.load, reads
    assert plain["step"] == 4 and plain["note"] == {"lr": 0.1}
    assert all(torch.equal(plain["model"][k], v) for k, v in state["model"].state_dict().items())

    other = training(fabric, seed=1)
    other["step"] = -1
    remainder = fabric.load(path, other)
    assert remainder == {"note": {"lr": 0.1}}, "the remainder is what the state did not ask for, as Fabric returns it"
    assert other["step"] == 4 and same_weights(other["model"], state["model"])
    assert other["optimizer"].state_dict()["state"].keys() == state["optimizer"].state_dict()["state"].keys()
    assert torch.equal(
        other["optimizer"].state_dict()["state"][0]["exp_avg"], state["optimizer"].state_dict()["state"][0]["exp_avg"]
    )


def test_resume_takes_the_newest_checkpoint_that_verifies_with_the_rng_and_numbers_go_on(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    fabric = make_fabric(root)
    state = training(fabric)
    assert resume(fabric, state) == {} and state["step"] == 0  # nothing committed: the state is left as it is
    for _ in range(2):
        train(fabric, state, 2)
        fabric.save(root / "last.pth", state)
    torch.manual_seed(123)
    train(fabric, state, 2)
    fabric.save(root / "last.pth", state)
    expected_draw = torch.rand(3)  # the draw after step 6's save
    train(fabric, state, 2)
    fabric.save(root / "last.pth", state)
    assert committed(root)[-3:] == [4, 6, 8]
    shard = next((root / "step-8").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))  # a bit flipped on disk

    again = make_fabric(root)
    resumed = training(again, seed=9)
    resume(again, resumed)
    assert resumed["step"] == 6, "the damaged newest step is never loaded: the one before it is"
    assert torch.equal(torch.rand(3), expected_draw), "the RNG is the saved run's at step 6"
    train(again, resumed, 1)
    again.save(root / "last.pth", resumed)
    assert 7 in committed(root)
    assert (root / "quarantine").is_dir()


def test_a_user_torch_save_file_and_a_raw_state_dict_load_as_fabric_loads_them(tmp_path: Path) -> None:
    fabric = make_fabric(tmp_path / "ckpt")
    source = training(fabric)
    train(fabric, source, 2)
    torch.save({"model": source["model"].state_dict(), "epoch": 3}, tmp_path / "theirs.pt")
    torch.save(source["model"].state_dict(), tmp_path / "raw.pt")

    target = training(fabric, seed=5)
    assert fabric.load(tmp_path / "theirs.pt", {"model": target["model"]}) == {"epoch": 3}
    assert same_weights(target["model"], source["model"])
    fresh = training(fabric, seed=6)
    fabric.load_raw(tmp_path / "raw.pt", fresh["model"])
    assert same_weights(fresh["model"], source["model"])
    assert committed(tmp_path / "ckpt") == []


def test_a_dict_without_an_optimizer_is_written_as_fabric_writes_it_and_is_never_resumed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    fabric = make_fabric(root)
    state = training(fabric)
    resume(fabric, state)
    train(fabric, state, 2)
    fabric.save(root / "full.pth", state)
    train(fabric, state, 1)
    fabric.save(tmp_path / "weights.pth", {"model": state["model"]})
    assert committed(root) == [2], "weights alone make no step"
    assert "training-resilience" not in torch.load(tmp_path / "weights.pth", weights_only=True)

    again = make_fabric(root)
    resumed = training(again, seed=3)
    resume(again, resumed)
    assert resumed["step"] == 2


def test_bad_input_is_refused_with_the_fix(tmp_path: Path) -> None:
    stock = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ConfigError, match=r"plugins=\[ResilientCheckpointIO"):
        resume(stock, training(stock))
    with pytest.raises(ConfigError, match=r"fabric\.setup"):
        HealthGuardCallback(signals=()).on_train_batch_end()

    fabric = make_fabric(tmp_path / "ckpt")
    state = training(fabric)
    with pytest.raises(FileNotFoundError, match=r"missing\.pth does not exist.*resume\(fabric, state\)"):
        fabric.load(tmp_path / "missing.pth", state)
    train(fabric, state, 1)
    with pytest.raises(ConfigError, match=r"'/step_fn'.*only pickle can store.*allow_pickle=True"):
        fabric.save(tmp_path / "x.pth", {**state, "step_fn": threading.Lock})
    assert committed(tmp_path / "ckpt") == []


def test_the_ranks_fabric_launch_starts_share_the_first_ranks_fork_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Fabric made with several devices leaves the environment alone until ``fabric.launch()`` starts the other
    ranks: they get this process's fork server in theirs (a rank started apart, by torchrun, has its own)."""
    server = ForkServer.get(early=True)
    assert isinstance(server, ForkServer)
    started: list[dict[str, str]] = []
    monkeypatch.setattr(subprocess, "Popen", lambda command, env, cwd: started.append(env))
    with mock.patch.dict(os.environ, {SHARE_VARIABLE: ""}):  # the launcher sets MASTER_PORT, WORLD_SIZE, ...
        os.environ.pop("LOCAL_RANK", None)
        io = ResilientCheckpointIO(str(tmp_path / "ckpt"), persist="process")
        fabric = Fabric(accelerator="cpu", devices=2, strategy="resilient_ddp", plugins=[io])
        assert os.environ[SHARE_VARIABLE] == ""
        fabric.strategy.launcher._call_children_scripts()  # what fabric.launch() runs first
    assert [env[SHARE_VARIABLE] for env in started] == [server.share]


def test_the_strategy_teardown_ends_the_packs_background_work_and_a_dropped_fabric_is_freed(tmp_path: Path) -> None:
    """Fabric calls nothing at the end of a run; ``Strategy.teardown()``, which reaches the plugin, finishes the
    last save and its file and stops what the saves started. Nothing of the pack keeps the strategy (and with it
    the engine's host buffers) alive once the script lets go of its Fabric."""
    before = set(threading.enumerate())
    fabric = make_fabric(tmp_path / "ckpt", sync_names_below_mb=0)
    state = training(fabric)
    resume(fabric, state)
    train(fabric, state, 2)
    fabric.save(tmp_path / "last.pth", state)
    fabric.strategy.teardown()
    assert committed(tmp_path / "ckpt") == [2] and (tmp_path / "last.pth").is_file()
    left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("resilience")]
    assert not left, left
    strategy = weakref.ref(fabric.strategy)
    del fabric, state
    gc.collect()
    assert strategy() is None
