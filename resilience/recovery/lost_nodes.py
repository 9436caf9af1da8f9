"""Nodes lost whole under ``resilience launch``: each launcher's heartbeat, and node 0's judgement of a node whose
launcher went silent after a failure (slow ranks, a node lost whole, or one a new launcher has replaced).

The heartbeat is a counter in the job's store that each launcher raises every second: node 0 watches it move, so
neither machine's clock is trusted. A node whose counter stood for ``node_lost_s`` (or that stayed silent for twice
the recovery timeout after a failure) is lost whole; a launcher started with its ``--node-rank`` while the job runs
joins (:func:`resilience.recovery.inplace.joined_key`), and node 0 then goes on without the lost one.

Node 0 watches the counters all the time, not only after a rank has failed: a node cut off by the network fails
nothing (its ranks and the others just wait in their collectives), so no failure would ever make node 0 look.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from resilience.recovery.inplace import beat_key, joined_key, node_lost_key, started_key
from resilience.recovery.launch_config import LaunchConfig

log = logging.getLogger(__name__)
BEAT_S = 1.0  # how often a launcher raises its heartbeat counter


class LostNodes:
    """One launcher's heartbeat, and on node 0 the watch on the others'."""

    def __init__(self, store: Any, config: LaunchConfig):
        self.store = store
        self.config = config
        self.beats: dict[int, tuple[int, float]] = {}  # each node's count, and when node 0 saw it move
        self.lost_at: float | None = None  # when this generation's silent nodes were found lost whole
        self.declared: set[int] = set()  # nodes found silent while the job ran (node 0)
        self._beat_at = self._watched_at = 0.0
        self.beat_due = False  # whether the last look raised the counter (a look a second, for what may wait)

    def next_generation(self) -> None:
        """A new generation began: its silent nodes, if any, are judged afresh."""
        self.lost_at = None
        self.declared.clear()

    def beat(self) -> None:
        """Raise this node's counter, at most every ``BEAT_S``."""
        self.beat_due = time.monotonic() - self._beat_at >= BEAT_S
        if self.beat_due:
            self._beat_at = time.monotonic()
            self.store.add(beat_key(self.config.node_rank), 1)

    def silent(self, generation: int) -> list[int]:
        """Node 0, at every look: the nodes whose counter has newly stood for ``node_lost_s``. Each is marked lost
        in the store (:func:`~resilience.recovery.inplace.node_lost_key`), where its own launcher, should it
        reach the store again, learns it is out of the job, and node 0's ranks learn whom to save without."""
        now = time.monotonic()
        if now - self._watched_at < BEAT_S:
            return []
        self._watched_at = now
        found = [
            node
            for node in range(1, self.config.nnodes)
            if node not in self.declared and self.store.check([started_key(node)]) and self._stood(node, now)
        ]
        for node in found:
            self.declared.add(node)
            self.store.set(node_lost_key(generation, node), "1")
            log.error(
                "node %d lost: its launcher's heartbeat stood for %.0f s (the node is gone, or cut off by the "
                "network); the ranks here save what their replicas hold and leave their collectives",
                node,
                self.config.node_lost_s,
            )
        return found

    def replaced(self, silent: list[int], generation: int, failing_since: float) -> bool | None:
        """For the ``silent`` nodes of a failed ``generation``: True once a launcher has joined for each node lost
        whole; False while they may still answer or be replaced; None when the job must end (no replacement
        within ``node_wait_s``)."""
        config, now = self.config, time.monotonic()
        if self.lost_at is None:
            stood = all(self._stood(node, now) for node in silent)
            if not stood and now - failing_since < 2 * config.recovery_timeout_s:
                return False  # slow ranks, not a lost node: the recovery timeout deals with them
            self.lost_at = now
            why = "their launchers' heartbeat stopped" if stood else "silent for twice --recovery-timeout-s"
            nodes = ",".join(map(str, silent))
            wait = f"waiting up to {config.node_wait_s:.0f} s for launchers started with --node-rank {nodes}"
            log.warning("node(s) %s lost whole (%s): %s", silent, why, wait if config.node_wait_s > 0 else "no wait")
        if all(self.store.check([joined_key(generation, node)]) for node in silent):
            log.warning("node(s) %s lost whole: replaced by the launcher(s) that joined", silent)
            return True
        return None if now - self.lost_at >= config.node_wait_s else False

    def _stood(self, node: int, now: float) -> bool:
        """Whether node ``node``'s counter has not moved for ``node_lost_s``, as seen from here."""
        count = int(self.store.add(beat_key(node), 0))
        seen = self.beats.get(node)
        if seen is None or seen[0] != count:
            self.beats[node] = (count, now)
            return False
        return now - seen[1] >= self.config.node_lost_s
