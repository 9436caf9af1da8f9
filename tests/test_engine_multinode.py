"""Two nodes on one host: two real torchrun agents (``--nnodes 2``), each node with a local root of its own
(``local_shared=False``) and one shared ``file://`` durable URL: commits per node and once for the job, a lost
node replaced by one with an empty disk, rank 0's node replaced, an upload failing on one node.

The engine tells nodes apart by the local root each rank writes to (:func:`resilience.dist.node_identity`),
so two agents on one host with their own roots are two nodes, as two machines would be. The single-process
tests first check the pieces that rests on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from resilience import CheckpointConfig, CheckpointManager
from resilience.dist import Topology, node_identity
from resilience.storage.manifest import FileEntry, Manifest, hash_bytes
from resilience.storage.peer_copies import held
from resilience.storage.processes import process_start_ticks
from tests.helpers import WORKERS, base_env, elastic_node, free_port, kill_job, record_tier_opens
from tests.workers.engine_worker import check_restored, state_for

WORKER = WORKERS / "multinode_worker.py"
JOB_TIMEOUT_S = 150
STEP = 5

pytestmark = pytest.mark.timeout(400)


# ---- single-process pieces (unit) ----------------------------------------------------------------------------


def test_node_identity_follows_the_local_root_directory_not_the_hostname(tmp_path: Path) -> None:
    """Ranks on one host with roots of their own are separate nodes; one directory under two paths is one."""
    a, b = tmp_path / "node-a", tmp_path / "node-b" / "deeper"
    (tmp_path / "alias").symlink_to(a, target_is_directory=True)
    ids = [node_identity(str(p)) for p in (a, b, tmp_path / "alias", a)]
    assert b.is_dir(), "the root is made, so it can be identified"
    assert ids[0] == ids[2] == ids[3] and ids[0] != ids[1]
    topology = Topology(rank=2, world_size=4, hosts=["host"] * 4, nodes=[ids[0], ids[0], ids[1], ids[1]])
    assert topology.ranks_on_my_node() == [2, 3] and not topology.single_node
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert node_identity(str(blocker / "root")) != ids[0]  # unusable: the set-up check then says why


def saved_in_both_tiers(tmp_path: Path) -> tuple[Path, str]:
    """Step 1 committed locally and durably by one process; the local root and the durable URL."""
    local, durable = tmp_path / "local", f"file://{tmp_path / 'durable'}"
    with CheckpointManager(CheckpointConfig(local, durable_url=durable)) as saver:
        saver.save(1, state_for(1, None), {"rank": torch.tensor([1])})
        saver.wait(durable=True)
    return local, durable


def load_recording_reads(
    local: Path, durable: str, monkeypatch: pytest.MonkeyPatch, **settings: Any
) -> list[tuple[str, str]]:
    """Load (the durable copy, as the local one is not loadable), check it bit-exact; the files read, but its
    manifest, with where each was read."""
    reads: list[tuple[str, str]] = []
    with monkeypatch.context() as patch:
        record_tier_opens(reads, patch.setattr)
        with CheckpointManager(CheckpointConfig(local, durable_url=durable, **settings)) as loader:
            target = state_for(0, None)
            restored = loader.load(target)
    assert restored is not None and restored.tier == "durable"
    check_restored(restored, target, 1, 0, None)
    return reads


def shards(reads: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(tier, name) for tier, name in reads if name.endswith(".distcp")]


def test_a_durable_load_reads_the_shards_the_local_disk_holds_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's disk holds its files of a checkpoint the durable tier commits (here the local manifest is gone:
    no node-local one is loadable): the durable copy is loaded, with the shards read from the local disk where
    the bytes match, and from the durable tier where they do not (another attempt at the same step)."""
    local, durable = saved_in_both_tiers(tmp_path)
    (local / "step-1" / "manifest.json").unlink()
    for proof in (local / "step-1").glob(".proof-*"):  # without the node's proof the bytes are checked first
        proof.unlink()  # (whether a proof holds depends on the clock: tests/test_proofs.py)
    reads = load_recording_reads(local, durable, monkeypatch)
    assert shards(reads) == [("local", "__0_0.distcp")] * 2  # checked, read
    assert {tier for tier, _ in reads} == {"local"}, "the small files too: of the durable tier only its manifest"
    shard = local / "step-1" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    reads = load_recording_reads(local, durable, monkeypatch)
    assert shards(reads) == [("local", "__0_0.distcp"), ("durable", "__0_0.distcp")]


def test_auto_verify_checks_durable_shards_by_size_and_full_downloads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify="auto" (the default) hashes shards only in the local tier: in the durable one that would download
    every shard twice. A fresh node (empty local disk) reads the durable shard once, or twice with "full"."""
    local, durable = saved_in_both_tiers(tmp_path)
    shutil.rmtree(local)
    assert shards(load_recording_reads(local, durable, monkeypatch)) == [("durable", "__0_0.distcp")]
    full = load_recording_reads(local, durable, monkeypatch, verify="full")
    assert shards(full) == [("durable", "__0_0.distcp")] * 2


# ---- two-node jobs -----------------------------------------------------------------------------------------


class Job:
    """Torchrun agents on this host, one per node, each node with the local root given at its start.

    The c10d rendezvous restarts a surviving node's workers when a replacement node joins, as on a cluster;
    the static one (``static``) gives each node the rank it is started with, as ``srun torchrun --node_rank``.
    """

    def __init__(self, tmp: Path, nproc: int, env: dict[str, str], *, static: bool = False) -> None:
        self.tmp = tmp
        self.nproc = nproc
        self.static = static
        self.durable = tmp / "durable"
        self.reports = tmp / "reports"
        self.reports.mkdir()
        self.port = free_port()
        self.env = base_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env})
        self.agents: list[subprocess.Popen[str]] = []

    def start(self, root: Path, node: int) -> subprocess.Popen[str]:
        """Start node ``node``'s agent; with c10d, node 0's agent hosts the rendezvous and must outlive the others."""
        log = self.tmp / f"agent-{len(self.agents)}-{root.name}.log"
        command = elastic_node(
            self.port,
            node,
            "multinode-test",
            self.nproc,
            WORKER,
            str(root),
            f"file://{self.durable}",
            str(self.reports),
            static=self.static,
        )
        with log.open("w") as out:
            agent = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        self.agents.append(agent)
        return agent

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text()[-5000:]}" for p in sorted(self.tmp.glob("agent-*.log")))

    def wait(self, agents: list[subprocess.Popen[str]]) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        for agent in agents:
            try:
                agent.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the job did not finish within {JOB_TIMEOUT_S}s\n{self.logs()}")
        if any(agent.returncode != 0 for agent in agents):
            pytest.fail(f"agents exited {[a.returncode for a in agents]}\n{self.logs()}")

    def wait_for_reports(self, count: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(found := self.read_reports()) < count:
            if time.monotonic() > deadline or any(agent.poll() is not None for agent in self.agents):
                pytest.fail(f"{len(found)} of {count} ranks reported\n{self.logs()}")
            time.sleep(0.2)
        return found

    def read_reports(self) -> list[dict[str, Any]]:
        return sorted((json.loads(p.read_text()) for p in self.reports.glob("*.json")), key=lambda r: r["rank"])


@contextlib.contextmanager
def job(tmp: Path, nproc: int, env: dict[str, str], *, static: bool = False) -> Iterator[Job]:
    running = Job(tmp, nproc, env, static=static)
    try:
        yield running
    finally:
        for agent in running.agents:
            kill_job(agent)


def manifest_at(step_dir: Path) -> Manifest:
    return Manifest.from_json((step_dir / "manifest.json").read_bytes(), where=str(step_dir), expected_step=None)


def by_root(reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    nodes: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        nodes.setdefault(report["root"], []).append(report)
    return nodes


def assert_read_own_files_locally(report: dict[str, Any], on_disk: Manifest) -> None:
    """The rank read some shards from its node's disk, only ones that disk holds, and none of those remotely."""
    own = {f.path for f in on_disk.files}
    local = {name for tier, name in report["reads"] if tier == "local"}
    remote = {name for tier, name in report["reads"] if tier == "durable"}
    assert local and local <= own and remote.isdisjoint(own), report["reads"]


def plant_leftover(root: Path, step: int, pid: int) -> None:
    """A save's leftover: a step directory without a manifest whose ``.writer.json`` names ``pid`` here."""
    step_dir = root / f"step-{step}"
    step_dir.mkdir(parents=True)
    (step_dir / "__0_0.distcp").write_bytes(b"partial")
    (step_dir / ".writer.json").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "start_ticks": None}))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 nodes x 2 ranks save step 5, then step 6, whose uploads fail on node b. Each root starts with two
    leftovers: one of a dead writer (step 99), one of a live one (98, named after this process)."""
    tmp = tmp_path_factory.mktemp("two-by-two")
    roots = [tmp / "node-a", tmp / "node-b"]
    for root in roots:
        plant_leftover(root, 99, dead_pid())
        plant_leftover(root, 98, os.getpid())
    env = {
        "TEST_STEPS": f"{STEP},{STEP + 1}",
        "TEST_FAIL_UPLOAD_ROOT": str(roots[1]),
        "TEST_FAIL_UPLOAD_STEP": str(STEP + 1),
    }
    with job(tmp, 2, env) as running:
        running.wait([running.start(roots[0], 0), running.start(roots[1], 1)])
        reports = running.read_reports()
    assert len(reports) == 4, reports
    return {"roots": roots, "durable": running.durable, "nodes": by_root(reports)}


def test_a_save_commits_locally_on_each_node_and_durably_once(two_by_two: dict[str, Any]) -> None:
    """Each node's leader (its lowest rank) commits a manifest of its own ranks' files only; one durable
    manifest lists every rank's files, each with the bytes of its writer's node (so uploaded from there: no
    other node has the file). Start-up clears each node's dead leftovers and leaves a live writer's alone;
    each node's owner record is gone once the job closes."""
    roots, nodes, durable_root = two_by_two["roots"], two_by_two["nodes"], two_by_two["durable"]
    assert sorted(nodes) == sorted(map(str, roots))
    durable = manifest_at(durable_root / f"step-{STEP}")
    assert durable.is_global and durable.world_size == 4
    listed: list[FileEntry] = []
    for root in roots:
        ranks = sorted(r["rank"] for r in nodes[str(root)])
        assert all(str(STEP) not in r["errors"] for r in nodes[str(root)])
        assert all(r["node_ranks"] == ranks for r in nodes[str(root)]), "the engine sees this node's ranks"
        assert [r["rank"] for r in nodes[str(root)] if r["leader"]] == [min(ranks)]
        local = manifest_at(root / f"step-{STEP}")
        assert local.ranks == ranks and not local.is_global
        assert {f.rank for f in local.files} == set(ranks) and {f.kind for f in local.files} >= {"shard", "state"}
        for entry in local.files:
            assert (root / f"step-{STEP}" / entry.path).stat().st_size == entry.size
            assert hash_bytes((durable_root / f"step-{STEP}" / entry.path).read_bytes()) == entry.xxh3_64
        assert [f.path for f in local.files] == [f.path for f in durable.files if f.rank in ranks]
        listed += local.files
        assert not (root / "step-99").exists(), "start-up clears this node's leftover of a dead writer"
        assert (root / "step-98" / ".writer.json").exists(), "and leaves a live writer's alone"
        assert not list((root / ".owners").glob("*.json")), "a closed job leaves no owner record"
    assert sorted(listed, key=lambda f: f.path) == sorted(durable.files, key=lambda f: f.path)
    assert len({f.path for f in listed}) == len(listed), "no file is in two nodes' local manifests"
    assert not (durable_root / f"step-{STEP}" / ".writer.json").exists()


def test_a_failed_upload_on_one_node_commits_nothing_durably_and_raises_on_both(two_by_two: dict[str, Any]) -> None:
    """Node b cannot upload step 6 (permission denied on its files only): the durable manifest must not appear,
    as it would name files node b never uploaded, every rank of both nodes gets the error, the local commits
    stand, and step 5 stays the newest durable checkpoint."""
    roots, nodes, durable_root = two_by_two["roots"], two_by_two["nodes"], two_by_two["durable"]
    for report in (r for root in roots for r in nodes[str(root)]):
        error = report["errors"][str(STEP + 1)]
        assert "Uploading the checkpoint failed" in error and "injected on this node" in error, error
    assert not (durable_root / f"step-{STEP + 1}" / "manifest.json").exists()
    node_b_files = {f.path for f in manifest_at(roots[1] / f"step-{STEP + 1}").files}
    assert not node_b_files & {p.name for p in (durable_root / f"step-{STEP + 1}").glob("*")}
    for root in roots:
        assert not manifest_at(root / f"step-{STEP + 1}").is_global
    assert manifest_at(durable_root / f"step-{STEP}").is_global


def peer_server(root: Path) -> tuple[tuple[str, int], int]:
    """The address and pid of the peer-copy server of the node whose local root is ``root``."""
    where = json.loads((root / ".peer" / "server.json").read_text())
    return (where["host"], where["port"]), where["pid"]


def wait_for_peer_copy(root: Path, run_id: str, rank: int, step: int) -> None:
    """Until the server of the node with ``root`` holds ``rank``'s files of ``step`` in memory."""
    address, _ = peer_server(root)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not any(c["rank"] == rank and c["step"] == step for c in held(address, run_id)):
        assert time.monotonic() < deadline, held(address, run_id)
        time.sleep(0.1)
    assert held(address, "another-run") == [], "a server tells only a reader that names the run"


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while process_start_ticks(pid) is not None:
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.1)


def lose_node_b(tmp_path: Path, *, peer_copy_lost: bool) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """2 nodes x 1 rank save step 5 and train on; once node a's server holds node b's files, node b is lost
    whole (its agent, worker and peer-copy server killed, its disk emptied), with ``peer_copy_lost`` node a's
    server too; a replacement node with an empty root joins, torchrun restarts node a's worker, and both
    resume (bit-exact, checked in the worker) and save step 6. The new node's and node a's resumed reports, and
    node a's root."""
    root_a, root_b, root_new = tmp_path / "node-a", tmp_path / "node-b", tmp_path / "node-new"
    with job(tmp_path, 1, {"TEST_STEPS": str(STEP), "TEST_PARK": "1"}) as running:
        agent_a = running.start(root_a, 0)
        agent_b = running.start(root_b, 1)
        for report in running.wait_for_reports(2):
            assert len(report["owners"]) == 1, report
            assert report["owners"][0].startswith(f"{socket.gethostname()}.{report['pid']}."), report
        [rank_b] = [r["rank"] for r in running.read_reports() if r["root"] == str(root_b)]
        run_id = manifest_at(root_a / f"step-{STEP}").run_id
        assert run_id is not None
        wait_for_peer_copy(root_a, run_id, rank_b, STEP)
        servers = {root: peer_server(root)[1] for root in (root_a, root_b)}
        kill_job(agent_b)  # the node is lost: its agent, its workers, its peer-copy server
        with contextlib.suppress(ProcessLookupError):
            os.kill(servers[root_b], signal.SIGKILL)
        shutil.rmtree(root_b)
        if peer_copy_lost:
            os.kill(servers[root_a], signal.SIGKILL)
        assert agent_a.poll() is None, "node a's agent survives the loss of node b"
        running.wait([agent_a, running.start(root_new, 1)])
        resumed = [r for r in running.read_reports() if r["restored"] is not None]
    for root in (root_a, root_new):  # a node's server ends with the launcher it watches
        wait_gone(peer_server(root)[1])
    assert len(resumed) == 2 and all(r["restored"] == STEP and not r["errors"] for r in resumed), resumed
    nodes = by_root(resumed)
    assert sorted(nodes) == sorted(map(str, (root_a, root_new)))
    [new], [kept] = nodes[str(root_new)], nodes[str(root_a)]
    # the killed leader's record on node a was cleared as dead; only the running leader's was left
    assert len(kept["owners"]) == 1 and kept["owners"][0].startswith(f"{socket.gethostname()}.{kept['pid']}.")
    assert manifest_at(running.durable / f"step-{STEP + 1}").is_global
    for root, steps in ((root_a, [STEP, STEP + 1]), (root_new, [STEP + 1])):
        assert sorted(int(p.parent.name[5:]) for p in root.glob("step-*/manifest.json")) == steps
        assert not manifest_at(root / f"step-{STEP + 1}").is_global
    return new, kept, root_a


@pytest.mark.slow  # the same resume from peers after a node lost whole runs by default under resilience launch
def test_a_lost_node_replaced_with_an_empty_disk_resumes_from_its_peers_without_the_durable_tier(
    tmp_path: Path,
) -> None:
    """Node b is lost whole after a durable commit (see :func:`lose_node_b`). The replacement reads every file of
    the step from its peers: node b's from node a's memory, node a's from node a's disk through its server;
    node a reads its own files from its disk and node b's from its server's memory. Neither reads any file of
    the step from the durable tier (only its listing and manifest)."""
    new, kept, root_a = lose_node_b(tmp_path, peer_copy_lost=False)
    assert new["reads"] and {tier for tier, _ in new["reads"]} == {"peer"}, new["reads"]
    assert {tier for tier, _ in kept["reads"]} == {"local", "peer"}, kept["reads"]
    own = {f.path for f in manifest_at(root_a / f"step-{STEP}").files}
    assert {name for tier, name in kept["reads"] if tier == "local"} <= own
    assert {name for tier, name in kept["reads"] if tier == "peer"}.isdisjoint(own)


@pytest.mark.slow  # the per-file fallback is tests/test_peer_copies.py's; this is the whole job's
def test_a_lost_node_whose_peer_copy_is_lost_too_resumes_from_the_durable_tier(tmp_path: Path) -> None:
    """As above, but node a's server dies with node b: node b's files are then nowhere but in the durable tier,
    and the replacement reads them there, and node a's files from node a's new server (its disk)."""
    new, kept, root_a = lose_node_b(tmp_path, peer_copy_lost=True)
    own = {f.path for f in manifest_at(root_a / f"step-{STEP}").files}
    durable = {name for tier, name in new["reads"] if tier == "durable"}
    peer = {name for tier, name in new["reads"] if tier == "peer"}
    assert durable and durable.isdisjoint(own) and peer and peer <= own, new["reads"]
    assert_read_own_files_locally(kept, manifest_at(root_a / f"step-{STEP}"))


def test_the_node_with_rank_0_replaced_while_another_disk_is_ahead_of_the_durable_tier(
    two_by_two: dict[str, Any], tmp_path: Path
) -> None:
    """After the 2 x 2 job, node b's disk holds step 6, committed there but never durably (its upload failed).
    Node a, which held ranks 0 and 1, is replaced by a node with an empty disk, and the whole job restarts on
    2 x 1 ranks with the new node as node 0. Both ranks resume step 5 from the durable tier bit-exact (node b
    reading the shards its disk holds there); node b's step 6 is of the abandoned branch and is set aside, so
    the new step 6 commits on both nodes and durably (it used to fail there on every try: FileExistsError)."""
    root_b, root_new = tmp_path / "node-b", tmp_path / "node-new"
    shutil.copytree(two_by_two["roots"][1], root_b)
    shutil.copytree(two_by_two["durable"], tmp_path / "durable")
    with job(tmp_path, 1, {}, static=True) as running:  # no TEST_STEPS: this run must resume
        running.wait([running.start(root_new, 0), running.start(root_b, 1)])
        reports = running.read_reports()
    assert len(reports) == 2 and all(r["restored"] == STEP and not r["errors"] for r in reports), reports
    [new], [kept] = by_root(reports)[str(root_new)], by_root(reports)[str(root_b)]
    assert new["rank"] == 0 and {tier for tier, _ in new["reads"]} == {"durable"}, new
    assert_read_own_files_locally(kept, manifest_at(root_b / f"step-{STEP}"))
    durable = manifest_at(running.durable / f"step-{STEP + 1}")
    assert durable.is_global and durable.world_size == 2
    for root, ranks in ((root_new, [0]), (root_b, [1])):
        local = manifest_at(root / f"step-{STEP + 1}")
        assert local.ranks == ranks and local.run_id == durable.run_id
    assert [p.name.split("-")[1] for p in (root_b / "superseded").iterdir()] == [str(STEP + 1)]
