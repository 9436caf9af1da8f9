"""Objects registered with ``register_for_checkpointing``: their state belongs to the user. What JSON and the
standard library's dates and times express comes back exactly; what only pickle can store is refused at the
save, with the fix, on every rank alike (a load would refuse it, and the run learn it only at a resume), or,
with ``allow_pickle=True``, kept as Accelerate keeps it."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState, GradientState

from accelerate_resilience import ResiliencePlugin, attach
from resilience.errors import ConfigError
from tests.helpers import WORKERS, accelerate_launch, base_env
from tests.test_accelerate_handle import committed_steps, new_job
from tests.workers.accelerate_objects import Progress


@pytest.fixture(autouse=True)
def fresh_accelerate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("ACCELERATE_RESILIENCE_") or name == "RESILIENCE_ALLOW_PICKLE":
            monkeypatch.delenv(name)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def save_and_load(root: Path, value: object, **settings: object) -> object:
    """Save a job whose registered object holds ``value``; load it into a new job; what the object holds then."""
    job = new_job()
    job.accelerator.register_for_checkpointing(Progress(value))
    with attach(job.accelerator, ResiliencePlugin(local_root=str(root), **settings)):  # type: ignore[arg-type]
        job.accelerator.save_state()
    job = new_job()
    loaded = Progress(None)
    job.accelerator.register_for_checkpointing(loaded)
    with attach(job.accelerator, ResiliencePlugin(local_root=str(root), **settings)) as resilience:  # type: ignore[arg-type]
        assert resilience.resume().restored
    return loaded.value


def test_dates_and_times_in_a_registered_objects_state_come_back_exactly(tmp_path: Path) -> None:
    value = {
        "started": dt.datetime.now(dt.timezone.utc),
        "local": dt.datetime(2021, 11, 7, 1, 30, 15, 250, fold=1),
        "offset": dt.datetime(2024, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30), "IST")),
        "day": dt.date(2024, 2, 29),
        "alarm": dt.time(6, 45),
        "budget": dt.timedelta(days=2, seconds=3, microseconds=4),
    }
    got = save_and_load(tmp_path, value)
    assert got == value
    assert {k: repr(v) for k, v in got.items()} == {k: repr(v) for k, v in value.items()}  # types, zones, fold


def test_a_value_only_pickle_stores_is_refused_at_the_save_and_kept_with_allow_pickle(tmp_path: Path) -> None:
    job = new_job()
    job.accelerator.register_for_checkpointing(Progress({"share": Fraction(1, 3)}))
    refused = r"Object 1 registered .*\(Progress\) .* fractions\.Fraction at '/value/share'.*\(allow_pickle=True\)"
    with (
        attach(job.accelerator, ResiliencePlugin(local_root=str(tmp_path / "refused"))),
        pytest.raises(ConfigError, match=refused),
    ):
        job.accelerator.save_state()
    assert committed_steps(tmp_path / "refused") == []
    assert save_and_load(tmp_path / "allowed", Fraction(1, 3), allow_pickle=True) == Fraction(1, 3)


def test_two_ranks_both_refuse_when_only_one_holds_such_a_value(tmp_path: Path) -> None:
    env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    env["HF_HOME"] = str(tmp_path / "hf-home")
    command = accelerate_launch(WORKERS / "accelerate_objects.py", str(tmp_path / "ck"))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for rank in (0, 1):
        assert f"REFUSED rank={rank} Object 0 registered for checkpointing (Progress)" in done.stdout, done.stdout
    assert committed_steps(tmp_path / "ck") == []
