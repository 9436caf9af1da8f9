"""Restart in place under ``resilience launch``: a lost rank is replaced and the healthy ranks keep their processes.

First the launcher's own rules, with ranks that train nothing (tests/workers/launch_probe.py): a lost rank goes
to a warm spare while the others run their script again in the same process, restarts are bounded, an agreed
stop ends the job with its code, a hung rank is ended on its peers' word, and a signal reaches every rank.
Then real training through the real Trainer and an Accelerate loop: kill -9 (rank 1, and rank 0 of three, the
rank that hosts the process group's store) and SIGSTOP of one rank mid-step; the survivors' PIDs stay, training
goes on from the survivors' save in the same command, and the final parameters are bit-exact with an
uninterrupted run. A preemption of every rank still takes the normal way: the job stops with 75, and the same
command run again resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience.recovery import preload as preload_module
from resilience.recovery.inplace import Target
from resilience.recovery.launch_config import auto_preload
from resilience.storage.processes import process_start_ticks
from tests.helpers import ROOT, WORKERS, base_env, free_port, kill_tree

PROBE = WORKERS / "launch_probe.py"
LIGHTNING = WORKERS / "lightning_train.py"
ACCELERATE = WORKERS / "accelerate_train.py"
TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(600)


def start(
    log: Path, nproc: int, script: Path, args: Sequence[str] = (), *, env: dict[str, str] | None = None, **options: Any
) -> subprocess.Popen[str]:
    """``resilience launch`` in a session of its own (its ranks are in its process group); output to ``log``."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    command = [sys.executable, "-m", "resilience.cli", "launch", f"--nproc-per-node={nproc}", *flags, str(script)]
    with log.open("w") as sink:  # not a pipe: a stopped rank would hold it open
        return subprocess.Popen(
            [*command, *args],
            env=base_env(env),
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def launch(log: Path, nproc: int, script: Path, args: Sequence[str] = (), **kwargs: Any) -> tuple[int, str]:
    proc = start(log, nproc, script, args, **kwargs)
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launch did not end in {TIMEOUT_S}s:\n{log.read_text()[-6000:]}") from None
    finally:
        kill_tree(proc)
    return proc.returncode, log.read_text()


def lines(output: str, tag: str) -> list[dict[str, Any]]:
    """The JSON bodies of ``tag`` lines (ranks share the output: a line may start in the middle of another's)."""
    return [json.loads(found) for found in re.findall(tag + r" (\{[^{}]*\})", output)]


def by_generation(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    return {(r["generation"], r["rank"]): r for r in records}


def same_params(a: Path, b: Path) -> bool:
    left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


# ---- the launcher's rules ------------------------------------------------------------------------------------


def test_a_lost_rank_goes_to_a_warm_spare_and_the_others_run_again_in_their_process(tmp_path: Path) -> None:
    """The spare starts as soon as the ranks say their first step is done, long before its longest delay."""
    plan = {"0:1": "late-die:3", "0:0": "fail"}
    env = {"PROBE_PLAN": json.dumps(plan), "PROBE_RUNNING": "0"}
    code, output = launch(tmp_path / "log", 2, PROBE, env=env, spare_delay_s=60, preload="tests.workers.preload_probe")
    assert code == 0, output
    seen = by_generation(lines(output, "PROBE"))
    assert set(seen) == {(0, 0), (0, 1), (1, 0), (1, 1)}, output
    assert seen[1, 0]["pid"] == seen[0, 0]["pid"], "the healthy rank's process was not kept"
    replacement = seen[1, 1]
    assert replacement["pid"] != seen[0, 1]["pid"]
    assert replacement["started"] < replacement["began"] - 0.5, "the replacement was not a process started ahead"
    assert "generation 1: rank(s) [1] replaced, the others restart in place (restart 1 of 3)" in output
    # the spare's imports took only idle CPU (they ran beside training); the rank it became runs as the others do,
    # a thread those imports started too
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert replacement["preload_nice"] == 19 and replacement["nice"] == replacement["pool_nice"] == own, output


def test_a_spare_that_may_not_put_a_priority_back_imports_at_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CAP_SYS_NICE or an RLIMIT_NICE that allows it, a thread lowered for the imports (and the threads they
    start) could never be put back: the imports then run at the process's own priority."""
    monkeypatch.setattr(preload_module, "_may_put_back", lambda: False)
    monkeypatch.delitem(sys.modules, "tests.workers.preload_probe", raising=False)
    preload_module.preload(["tests.workers.preload_probe"])
    probe = sys.modules.pop("tests.workers.preload_probe")
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert own == probe.NICE and os.getpriority(os.PRIO_PROCESS, probe.POOL_THREAD) == own


def test_no_spare_starts_before_the_ranks_say_their_first_step_is_done(tmp_path: Path) -> None:
    """Its imports would compete with the ranks' start for the cores: within the delay, and before the ranks of a
    generation say they run, a loss gets a replacement started cold."""
    plan = {"0:1": "die:3", "0:0": "fail"}
    code, output = launch(tmp_path / "log", 2, PROBE, env={"PROBE_PLAN": json.dumps(plan)}, spare_delay_s=60)
    assert code == 0, output
    seen = by_generation(lines(output, "PROBE"))
    assert seen[1, 1]["started"] > seen[1, 1]["began"] - 0.05, "a spare was started before the ranks ran"
    assert seen[1, 0]["pid"] == seen[0, 0]["pid"]


def test_a_one_node_launcher_opens_its_store_once_the_ranks_say_their_first_step_is_done(tmp_path: Path) -> None:
    """Its import of torch would compete with the ranks' own start for the cores, and no one needs the store of a
    one-node job before a failure: it opens once every rank has said it runs."""
    plan = {"0:0": "store-after-first-step", "0:1": "store-after-first-step"}
    code, output = launch(tmp_path / "log", 2, PROBE, env={"PROBE_PLAN": json.dumps(plan)}, spare_delay_s=60)
    assert code == 0, output
    seen = lines(output, "STORE")
    assert len(seen) == 2 and all(not r["before"] and r["after"] for r in seen), output


def test_the_spare_a_restart_took_is_started_again_only_after_the_delay(tmp_path: Path) -> None:
    """After a restart too, the spare waits for the ranks' word (here: none in generation 1) or the delay."""
    plan = {"0:1": "late-die:3", "0:0": "fail", "1:1": "late-die:3", "1:0": "fail"}
    env = {"PROBE_PLAN": json.dumps(plan), "PROBE_RUNNING": "0"}
    code, output = launch(tmp_path / "log", 2, PROBE, env=env, spare_delay_s=60)
    assert code == 0, output
    seen = by_generation(lines(output, "PROBE"))
    assert seen[1, 1]["started"] < seen[1, 1]["began"] - 0.5, "the first replacement was not the warm spare"
    assert seen[2, 1]["started"] > seen[2, 1]["began"] - 0.05, "a spare was started within the delay"
    assert seen[2, 0]["pid"] == seen[0, 0]["pid"]


def test_restarts_are_bounded_and_the_job_ends_with_the_lost_ranks_code(tmp_path: Path) -> None:
    plan = {f"{g}:1": "die:3" for g in range(4)} | {f"{g}:0": "fail" for g in range(4)}
    code, output = launch(tmp_path / "log", 2, PROBE, env={"PROBE_PLAN": json.dumps(plan)}, max_restarts=2, spares=0)
    assert code == 3, output
    assert {r["generation"] for r in lines(output, "PROBE")} == {0, 1, 2}
    assert "not restarted (no restarts left)" in output


def test_an_agreed_stop_ends_the_job_with_its_code_and_nothing_restarts(tmp_path: Path) -> None:
    plan = {"0:0": "stop:75", "0:1": "stop:75"}
    code, output = launch(tmp_path / "log", 2, PROBE, env={"PROBE_PLAN": json.dumps(plan)})
    assert code == 75, output
    assert {r["generation"] for r in lines(output, "PROBE")} == {0}
    assert "replaced" not in output


def test_a_hung_rank_is_ended_on_its_peers_word(tmp_path: Path) -> None:
    """A hang is named after steps were done (the ranks said they run, so the store of a one-node job is open)."""
    plan = {"0:1": "hang", "0:0": "evict:1"}
    code, output = launch(tmp_path / "log", 2, PROBE, env={"PROBE_PLAN": json.dumps(plan), "PROBE_RUNNING": "0"})
    assert code == 0, output
    assert "rank 1 is hung (its peers say so): ending it" in output
    seen = by_generation(lines(output, "PROBE"))
    assert seen[1, 0]["pid"] == seen[0, 0]["pid"] and seen[1, 1]["pid"] != seen[0, 1]["pid"]


def ready_ranks(log: Path, ready: int = 2) -> subprocess.Popen[str]:
    """A 2-rank launch whose ranks wait, each leaving with 75 on SIGTERM; returned once ``ready`` are ready."""
    proc = start(log, 2, PROBE, env={"PROBE_PLAN": json.dumps({"0:0": "sigterm", "0:1": "sigterm"})})
    deadline = time.monotonic() + TIMEOUT_S
    while log.read_text().count("READY") < ready:
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc)
            raise AssertionError(log.read_text())
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("ready", [2, 1], ids=["ranks-ready", "as-the-ranks-start"])
def test_a_signal_to_the_launcher_reaches_every_rank(tmp_path: Path, ready: int) -> None:
    """``as-the-ranks-start``: node 0's launcher starts its ranks before it opens the job's store (it imports
    torch meanwhile): a signal then still ends the job, with the code of a stop."""
    proc = ready_ranks(tmp_path / "log", ready)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        kill_tree(proc)
    output = (tmp_path / "log").read_text()
    assert proc.returncode == 75, output
    assert "Traceback" not in output, output


def test_ranks_leave_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """kill -9 of the launcher itself: its ranks get SIGTERM (the parent-death signal), as from a scheduler; the
    folder it kept for its ranks' marks is removed by the next launch."""
    log = tmp_path / "log"
    proc = ready_ranks(log)
    try:
        pids = [r["pid"] for r in lines(log.read_text(), "PROBE")]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(process_start_ticks(pid) is not None for pid in pids):
            assert time.monotonic() < deadline, "a rank outlived its launcher"
            time.sleep(0.05)
    finally:
        kill_tree(proc)
    left = list(Path(tempfile.gettempdir()).glob(f"resilience-launch-{proc.pid}-*"))
    assert left, "the launcher killed outright made no folder for its ranks' marks"
    code, output = launch(tmp_path / "next.log", 1, PROBE)
    assert code == 0, output
    assert not any(path.exists() for path in left), "the next launch left the dead launcher's folder"


def nodes(tmp: Path, plan: dict[str, str], **options: Any) -> list[subprocess.Popen[str]]:
    """Two launchers on this host as two nodes of one rank each, sharing node 0's store."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {"PROBE_PLAN": json.dumps(plan)}
    return [
        start(tmp / f"node-{n}.log", 1, PROBE, env=env, nnodes=2, node_rank=n, rdzv_endpoint=endpoint, **options)
        for n in (0, 1)
    ]


def wait_all(procs: list[subprocess.Popen[str]], tmp: Path) -> list[int]:
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S)
    finally:
        for proc in procs:
            kill_tree(proc)
    return [proc.returncode for proc in procs]


def kill_node_when(procs: list[subprocess.Popen[str]], tmp: Path, marker: str, *, victim: int) -> list[int]:
    """Kill node ``victim`` whole (its launcher and ranks) once node 1's log shows ``marker``; every node's code."""
    log = tmp / "node-1.log"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while marker not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        kill_tree(procs[victim])
    finally:
        codes = wait_all(procs, tmp)
    return codes


def test_two_nodes_each_replace_their_own_lost_rank(tmp_path: Path) -> None:
    codes = wait_all(nodes(tmp_path, {"0:1": "late-die:3", "0:0": "fail"}), tmp_path)
    output = (tmp_path / "node-0.log").read_text() + (tmp_path / "node-1.log").read_text()
    assert codes == [0, 0], output
    seen = by_generation(lines(output, "PROBE"))
    assert set(seen) == {(0, 0), (0, 1), (1, 0), (1, 1)}, output
    assert seen[1, 0]["pid"] == seen[0, 0]["pid"] and seen[1, 1]["pid"] != seen[0, 1]["pid"]
    assert "generation 1: rank(s) [1] replaced" in (tmp_path / "node-1.log").read_text()
    assert "generation 1: rank(s) [] replaced" in (tmp_path / "node-0.log").read_text()


def test_a_node_lost_whole_ends_the_job_for_the_scheduler(tmp_path: Path) -> None:
    """Node 1's launcher and rank are killed: nobody can replace rank 1, so node 0 gives up with 75."""
    procs = nodes(tmp_path, {"0:1": "hang", "0:0": "fail"}, recovery_timeout_s=2, spares=0)
    codes = kill_node_when(procs, tmp_path, "PROBE", victim=1)
    output = (tmp_path / "node-0.log").read_text()
    assert codes[0] == 75, output
    assert "a node's launcher did not answer after the failure" in output


def test_node_0_keeps_the_store_up_until_every_node_has_left(tmp_path: Path) -> None:
    """Node 0's rank ends at once, node 1's 3 s later: node 1's launcher still reads the store meanwhile (it
    failed with a closed connection when node 0's launcher left first)."""
    codes = wait_all(nodes(tmp_path, {"0:1": "linger"}), tmp_path)
    output = (tmp_path / "node-0.log").read_text() + (tmp_path / "node-1.log").read_text()
    assert codes == [0, 0], output


def test_a_node_whose_store_host_is_lost_stops_its_ranks_for_the_scheduler(tmp_path: Path) -> None:
    """Node 0 (launcher, rank and the job's store) is killed: node 1 cannot agree on anything any more, so it
    stops its rank (SIGTERM: the rank leaves with 75) and ends with 75 instead of a traceback."""
    procs = nodes(tmp_path, {"0:0": "hang", "0:1": "sigterm"}, spares=0)
    codes = kill_node_when(procs, tmp_path, "READY", victim=0)
    output = (tmp_path / "node-1.log").read_text()
    assert codes[1] == 75, output
    assert "the job's store on node 0 is gone" in output


def test_a_spare_preloads_the_scripts_libraries_but_never_the_users_own_modules() -> None:
    found = auto_preload(Target.parse([str(LIGHTNING)]))
    assert "torch" in found and "lightning.pytorch" in found
    assert not any(name.split(".")[0] in ("examples", "tests", "lightning_resilience") for name in found), found


# ---- real training -------------------------------------------------------------------------------------------


def lightning(tmp: Path, nproc: int, *args: str, **options: Any) -> tuple[int, str]:
    command = ["--root", str(tmp), "--devices", str(nproc), "--out", str(tmp / "final.pt"), *args]
    tmp.mkdir(parents=True, exist_ok=True)
    return launch(tmp / "launch.log", nproc, LIGHTNING, command, **options)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank fit under the launcher (its normal path)."""
    root = tmp_path_factory.mktemp("reference")
    code, output = lightning(root, 2)
    assert code == 0, output[-6000:]
    return root / "final.pt"


def check_restarted_in_place(output: str, nproc: int, victim: int, step: int) -> None:
    """Every rank resumed ``step`` in generation 1; the survivors in their own process, holding nothing of
    generation 0 (the pack's threads, plugins and Trainers are the first generation's in number)."""
    seen = by_generation(lines(output, "START"))
    assert set(seen) == {(g, r) for g in (0, 1) for r in range(nproc)}, output[-6000:]
    for rank in range(nproc):
        first, second = seen[0, rank], seen[1, rank]
        assert second["step"] == step, (rank, second)
        assert (second["pid"] == first["pid"]) == (rank != victim), (rank, first, second)
        assert (second["threads"], second["plugins"], second["trainers"]) == (first["threads"], 1, 1), second


@pytest.mark.parametrize("how", ["kill", "stop"], ids=["kill-9", "sigstop"])
def test_lightning_ranks_restart_in_place_after_a_lost_rank_and_end_bit_exact(
    tmp_path: Path, reference: Path, how: str
) -> None:
    args = ["--victim", f"1:7:{how}", "--step-sleep", "0.1"]
    if how == "stop":
        args += ["--health", "--hang-min-s", "4"]
    code, output = lightning(tmp_path, 2, *args)
    assert code == 0, output[-6000:]
    assert "survivor save of step 7 by ranks [0] (lost: [1]): committed" in output
    if how == "stop":
        assert "rank 1 is hung (its peers say so): ending it" in output
    check_restarted_in_place(output, 2, victim=1, step=7)
    assert same_params(tmp_path / "final.pt", reference), "the run restarted in place differs from an uninterrupted one"


def test_three_lightning_ranks_lose_rank_0_and_go_on_bit_exact(tmp_path: Path) -> None:
    """Rank 0 hosts the process group's store: its replacement hosts the next generation's. Three ranks sum
    gradients in an order DDP's buckets decide, hence ``--fixed-buckets`` (docs/LIGHTNING.md)."""
    code, output = lightning(tmp_path / "reference", 3, "--fixed-buckets")
    assert code == 0, output[-6000:]
    code, output = lightning(tmp_path / "run", 3, "--fixed-buckets", "--victim", "0:7:kill", "--step-sleep", "0.1")
    assert code == 0, output[-6000:]
    assert "survivor save of step 7 by ranks [1, 2] (lost: [0]): committed" in output
    check_restarted_in_place(output, 3, victim=0, step=7)
    assert same_params(tmp_path / "run" / "final.pt", tmp_path / "reference" / "final.pt")


def test_a_preemption_of_every_rank_stops_the_job_and_the_same_command_resumes(tmp_path: Path, reference: Path) -> None:
    args = ["--root", str(tmp_path), "--devices", "2", "--health", "--step-sleep", "0.2"]
    args += ["--out", str(tmp_path / "final.pt")]
    log = tmp_path / "launch.log"
    proc = start(log, 2, LIGHTNING, args)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (tmp_path / "ckpt" / "step-4" / "manifest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc)
    output = log.read_text()
    assert proc.returncode == 75, output[-6000:]
    assert "replaced" not in output and {r["generation"] for r in lines(output, "START")} == {0}
    code, output = launch(tmp_path / "again.log", 2, LIGHTNING, args)
    assert code == 0, output[-6000:]
    assert all(r["step"] > 4 for r in lines(output, "START")), "the relaunch did not resume past the stop"
    assert same_params(tmp_path / "final.pt", reference)


def accelerate(out: Path, **settings: str) -> tuple[int, str]:
    out.mkdir(parents=True)
    env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    env.update(HF_HOME=str(out / "hf-home"), ACCELERATE_RESILIENCE_LOCAL_ROOT=str(out / "ckpt"), **settings)
    return launch(out / "launch.log", 2, ACCELERATE, [str(out)], env=env)


@pytest.fixture(scope="module")
def accelerate_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank Accelerate loop under the launcher; its folder of final states."""
    out = tmp_path_factory.mktemp("accelerate") / "reference"
    code, output = accelerate(out)
    assert code == 0, output[-6000:]
    return out


def same_final_states(run: Path, reference: Path) -> None:
    """Each rank's final model and sample indices are the uninterrupted run's, bit for bit."""
    for rank in (0, 1):
        got = torch.load(run / f"final-rank{rank}.pt", weights_only=False)
        want = torch.load(reference / f"final-rank{rank}.pt", weights_only=False)
        assert got["indices"] == want["indices"], f"rank {rank} trained on other samples"
        for name, tensor in want["model"].items():
            assert torch.equal(got["model"][name], tensor), f"rank {rank}: {name} differs"


def test_an_accelerate_loop_restarts_in_place_after_a_kill_9_and_ends_bit_exact(
    tmp_path: Path, accelerate_reference: Path
) -> None:
    code, output = accelerate(tmp_path / "run", ACCELERATE_RESILIENCE_EVERY_N_STEPS="4", TRAIN_VICTIM="1:7")
    assert code == 0, output[-6000:]
    assert "survivor save of step 7 by ranks [0] (lost: [1]): committed" in output
    # a handled loss is one line, not the gloo error's traceback (the survivors save inside Accelerate's hook)
    assert "Traceback" not in output and "rank 0: training ended as its peer was lost" in output, output[-6000:]
    resumed = [json.loads(found) for found in re.findall(r"RESUME rank=\d (\{[^{}]*\})", output)]
    assert [r["global_step"] for r in resumed] == [0, 0, 7, 7], output[-6000:]
    same_final_states(tmp_path / "run", accelerate_reference)
    # rank 0's ledger: the survivor's incarnation ended asking for the restart, the next one began in place
    report = subprocess.run(
        [sys.executable, "-m", "resilience.cli", "report", str(tmp_path / "run" / "ckpt"), "--json"],
        env=base_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    incarnations = json.loads(report.stdout)["incarnations"]
    assert [inc["restart"] for inc in incarnations] == [None, "in place"]
    assert incarnations[0]["end_reason"].startswith("restarting in place: rank(s) [1] lost; survivor save committed")
    assert 0 < incarnations[1]["recovery_s"] < 60


def test_two_accelerate_nodes_with_their_own_disks_restart_in_place_from_the_last_commit(
    tmp_path: Path, accelerate_reference: Path
) -> None:
    """Each node its own local root, one durable URL: no survivor save (no local tier both ranks see), so the
    job restarts in place from the last commit (step 4), rank 1 in a spare on its own node, and ends bit-exact."""
    out = tmp_path / "run"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in (0, 1):
        env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
        env.update(
            HF_HOME=str(out / "hf-home"),
            ACCELERATE_RESILIENCE_LOCAL_ROOT=str(out / f"node-{node}"),
            ACCELERATE_RESILIENCE_DURABLE_URL=(out / "durable").as_uri(),
            ACCELERATE_RESILIENCE_EVERY_N_STEPS="4",
            TRAIN_VICTIM="1:7",
        )
        log = out / f"node-{node}.log"
        procs.append(start(log, 1, ACCELERATE, [str(out)], env=env, nnodes=2, node_rank=node, rdzv_endpoint=endpoint))
    codes = wait_all(procs, out)
    output = (out / "node-0.log").read_text() + (out / "node-1.log").read_text()
    assert codes == [0, 0], output[-6000:]
    assert output.count("survivor saves of a lost rank need a local tier every rank sees") == 1, (
        "said once, not per generation"
    )
    # the lost peer's error, handled by the restart: one line, its traceback at DEBUG only
    assert "Traceback" not in output and "rank 0: training ended as a peer was lost" in output, output[-6000:]
    node_1 = (out / "node-1.log").read_text()
    assert "rank 1 left with signal SIGKILL" in node_1 and "generation 1: rank(s) [1] replaced" in node_1, node_1
    resumed = [json.loads(found) for found in re.findall(r"RESUME rank=\d (\{[^{}]*\})", output)]
    assert sorted(r["global_step"] for r in resumed) == [0, 0, 4, 4], output[-6000:]
    same_final_states(out, accelerate_reference)


def node_env(out: Path, root: Path, **extra: str) -> dict[str, str]:
    """One node's environment for the Accelerate loop: its own local root, the job's durable URL."""
    env = {k: v for k, v in base_env().items() if not k.startswith("ACCELERATE_")}
    env.update(
        HF_HOME=str(out / "hf-home"),
        ACCELERATE_RESILIENCE_LOCAL_ROOT=str(root),
        ACCELERATE_RESILIENCE_DURABLE_URL=(out / "durable").as_uri(),
        ACCELERATE_RESILIENCE_EVERY_N_STEPS="4",
        **extra,
    )
    return env


def test_a_node_lost_whole_is_replaced_by_a_new_launcher_and_the_job_goes_on_from_its_peers(
    tmp_path: Path, accelerate_reference: Path
) -> None:
    """Two nodes of one rank, each its own local root. Once node 0's peer-copy server holds rank 1's files of
    step 4, node 1 is lost whole: its launcher, rank and server killed, its disk gone. A launcher started with
    ``--node-rank 1`` on a new root takes its place (``--node-wait-s``): node 0 announces the next generation,
    its rank runs again in place, the new node's rank starts fresh, both resume from the newest durable step
    (the new node reading from its peer), and the job ends bit-exact with an uninterrupted one."""
    out = tmp_path / "run"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    # a recovery timeout longer than the test's: node 1 can only be found lost by its launcher's heartbeat, which
    # stands for node_lost_s (8, not the default 30: the same rule, sooner)
    options: dict[str, Any] = {"nnodes": 2, "rdzv_endpoint": endpoint, "recovery_timeout_s": 300, "node_wait_s": 120}
    options["node_lost_s"] = 8
    roots = [out / "node-0", out / "node-1", out / "node-new"]
    env = {"TRAIN_STEP_SLEEP": "0.5"}  # step 8's commit comes 2 s after step 4's: the kill is well before it
    procs = [
        start(
            out / f"{root.name}.log",
            1,
            ACCELERATE,
            [str(out)],
            env=node_env(out, root, **env),
            node_rank=node,
            **options,
        )
        for node, root in enumerate(roots[:2])
    ]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (roots[0] / "step-4" / "manifest.json").exists() or not peer_holds(roots[0], 1, 4):
            assert time.monotonic() < deadline and procs[1].poll() is None, (out / "node-1.log").read_text()[-4000:]
            time.sleep(0.1)
        server = json.loads((roots[1] / ".peer" / "server.json").read_text())["pid"]
        kill_tree(procs[1])
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGKILL)
        shutil.rmtree(roots[1])
        new = start(
            out / "node-new.log", 1, ACCELERATE, [str(out)], env=node_env(out, roots[2], **env), node_rank=1, **options
        )
        codes = wait_all([procs[0], new], out)
    finally:
        for proc in procs:
            kill_tree(proc)
    output = (out / "node-0.log").read_text() + (out / "node-new.log").read_text()
    assert codes == [0, 0], output[-6000:]
    assert "node(s) [1] lost whole (their launchers' heartbeat stopped)" in output, output[-6000:]
    assert "node(s) [1] lost whole: replaced by the launcher(s) that joined" in output, output[-6000:]
    assert "node 1 was lost: this launcher takes its place" in output, output[-6000:]
    assert "Traceback" not in output and "rank 0: training ended as a peer was lost" in output, output[-6000:]
    resumed = [json.loads(found) for found in re.findall(r"RESUME rank=\d (\{[^{}]*\})", output)]
    assert (
        len(resumed) == 3
        and resumed[0]["global_step"] == 0
        and resumed[1]["global_step"] == resumed[2]["global_step"] >= 4
    )
    # rank 0 (whose lines show) read node 1's files from its own node's server: that copy is all that is left
    assert "from peers' memory" in (out / "node-0.log").read_text(), output[-6000:]
    same_final_states(out, accelerate_reference)


def peer_holds(root: Path, rank: int, step: int) -> bool:
    """Whether the peer-copy server of the node with ``root`` holds ``rank``'s files of ``step``."""
    from resilience.storage.peer_copies import held

    try:
        where = json.loads((root / ".peer" / "server.json").read_text())
        run_id = json.loads((root / f"step-{step}" / "manifest.json").read_text())["run_id"]
        return any(c["rank"] == rank and c["step"] >= step for c in held((where["host"], where["port"]), run_id))
    except (OSError, ValueError, KeyError):
        return False


def test_a_configuration_error_ends_the_job_instead_of_being_run_again(tmp_path: Path) -> None:
    """A ConfigError fails the same way at every try: the rank leaves with 2 (a usage error), the other with it, and
    the launcher does not start the script again (it ran a fixed configuration error three times)."""
    script = tmp_path / "misconfigured.py"
    script.write_text(
        "import os\nfrom resilience.errors import ConfigError\n"
        "print('STARTED', os.environ['RANK'], flush=True)\n"
        "raise ConfigError('keep_last=0: keep at least one checkpoint')\n"
    )
    code, output = launch(tmp_path / "launch.log", 2, script)
    assert code == 2, output[-4000:]
    assert output.count("STARTED") == 2 and "replaced" not in output, output[-4000:]
    assert "keep_last=0: keep at least one checkpoint" in output
