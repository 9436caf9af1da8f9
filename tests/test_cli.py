"""The ``resilience`` command as a user runs it: distinct exit codes, step folders, --version, pipes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager, __version__
from resilience.cli import EXIT_ERROR, EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from resilience.cli import main as cli
from resilience.goodput import GoodputLedger
from tests.helpers import ROOT, base_env


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resilience.cli", *args], cwd=ROOT, env=base_env(), capture_output=True, text=True
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    with CheckpointManager(CheckpointConfig(tmp_path / "ckpt")) as manager:
        manager.save(3, {"w": torch.arange(1000.0)})
    return tmp_path / "ckpt"


def test_exit_codes_tell_success_failed_checks_usage_and_missing_roots(root: Path, tmp_path: Path) -> None:
    assert cli(["verify", str(root)]) == EXIT_OK
    assert cli(["ls", str(tmp_path / "nowhere")]) == EXIT_NOT_FOUND
    assert cli(["upload", str(tmp_path / "nowhere"), str(tmp_path / "durable")]) == EXIT_NOT_FOUND
    assert cli(["report", str(tmp_path / "nowhere")]) == EXIT_NOT_FOUND
    assert cli(["ls", "s3//bucket/run"]) == EXIT_ERROR  # a mistyped URL is an error, not an empty folder
    with pytest.raises(SystemExit) as usage:
        cli(["verify"])
    assert usage.value.code == EXIT_USAGE
    shard = next(root.glob("step-3/__*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli(["verify", str(root)]) == EXIT_FAILED


def test_verify_takes_a_step_folder(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["verify", str(root / "step-3")]) == EXIT_OK
    assert "OK   step 3" in capsys.readouterr().out
    assert cli(["ls", str(root / "step-3"), "--json"]) == EXIT_OK


def test_verify_reports_an_unfinished_folder_without_failing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "step-5").mkdir()  # a save cut short: shards, no manifest
    (root / "step-5" / "__0_0.distcp").write_bytes(b"partial")
    assert cli(["verify", str(root)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "SKIP step 5" in out and "not committed" in out and "OK   step 3" in out
    assert cli(["verify", str(root), "--step", "5"]) == EXIT_NOT_FOUND  # no checkpoint of step 5 to check
    shard = next(root.glob("step-3/__*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1])
    assert cli(["verify", str(root)]) == EXIT_FAILED  # a committed step that fails still fails


def test_version_and_a_closed_pipe(root: Path) -> None:
    shown = run("--version")
    assert shown.returncode == 0 and __version__ in shown.stdout
    assert "exit codes" in run("--help").stdout
    piped = subprocess.run(
        f"{sys.executable} -m resilience.cli ls {root} --json | head -c 1",
        shell=True,
        cwd=ROOT,
        env=base_env(),
        capture_output=True,
        text=True,
    )
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr


def modules_loaded_by(*args: str) -> set[str]:
    """The top-level packages a ``resilience`` command imported, as the installed entry point runs it."""
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['resilience', *{list(args)!r}]\n"
        "try:\n"
        "    runpy.run_module('resilience.cli', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('MODULES', ' '.join(sorted({name.split('.')[0] for name in sys.modules})), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=base_env(), capture_output=True, text=True, check=True
    )
    line = next(line for line in done.stderr.splitlines() if line.startswith("MODULES "))
    return set(line.split()[1:])


def test_version_help_and_ls_do_not_import_torch(root: Path, tmp_path: Path) -> None:
    """Importing torch (and DCP) took 2 to 7 s, and ``resilience --version`` paid it: only the commands that read
    tensors import it."""
    GoodputLedger(tmp_path / "run").end()
    for args in (
        ["--version"],
        ["--help"],
        ["ls", str(root)],
        ["verify", str(root)],
        ["report", str(tmp_path / "run")],
    ):
        loaded = modules_loaded_by(*args)
        assert "resilience" in loaded and "torch" not in loaded, args


def test_ls_of_the_run_folder_names_the_checkpoint_root_below_it(root: Path, tmp_path: Path) -> None:
    """``resilience ls RUN`` for ``RUN/ckpt`` printed "no checkpoints found" and exited 0: it exits 3 and says
    where the checkpoints are, with the command that lists them."""
    above = run("ls", str(tmp_path))
    assert above.returncode == EXIT_NOT_FOUND, above
    assert f"no checkpoints in {tmp_path}" in above.stderr
    assert f"{root} (1 step)" in above.stderr and f"Run: resilience ls {root}" in above.stderr
    listed = run("ls", str(root))
    assert listed.returncode == EXIT_OK and "step-3" in listed.stdout
    (tmp_path / "empty").mkdir()
    empty = run("ls", str(tmp_path / "empty"), "--json")
    assert empty.returncode == EXIT_NOT_FOUND and empty.stdout.strip() == "[]"
    assert "no step-<N> folder there" in empty.stderr
