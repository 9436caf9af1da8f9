"""Several nodes: the engine tells them apart by the local root each rank writes to
(:func:`resilience.dist.node_identity`), so two agents on one host with roots of their own are two nodes, as two
machines would be; a durable load reads what a node's own disk still holds there.
"""

from __future__ import annotations

from pathlib import Path

from resilience.dist import Topology, node_identity

# ---- single-process pieces (unit) ----------------------------------------------------------------------------


def test_node_identity_follows_the_local_root_directory_not_the_hostname(tmp_path: Path) -> None:
    """Ranks on one host with roots of their own are separate nodes; one directory under two paths is one."""
    a, b = tmp_path / "node-a", tmp_path / "node-b" / "deeper"
    (tmp_path / "alias").symlink_to(a, target_is_directory=True)
    ids = [node_identity(str(p)) for p in (a, b, tmp_path / "alias", a)]
    assert b.is_dir(), "the root is made, so it can be identified"
    assert ids[0] == ids[2] == ids[3] and ids[0] != ids[1]
    topology = Topology(rank=2, world_size=4, hosts=[ids[0], ids[0], ids[1], ids[1]])
    assert topology.ranks_on_my_host() == [2, 3] and not topology.single_host
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert node_identity(str(blocker / "root")) != ids[0]  # unusable: the set-up check then says why
