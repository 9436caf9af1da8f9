"""Nodes lost whole under ``resilience launch``: each launcher's heartbeat, and node 0's judgement of a node whose
launcher went silent after a failure (slow ranks, a node lost whole, or one a new launcher has replaced).

The heartbeat is a counter in the job's store that each launcher raises every second: node 0 watches it move, so
neither machine's clock is trusted. A node whose counter stood for ``BEAT_LOST_S`` (or that stayed silent for twice
the recovery timeout) is lost whole; a launcher started with its ``--node-rank`` while the job runs joins
(:func:`resilience.recovery.inplace.joined_key`), and node 0 then goes on without the lost one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from resilience.recovery.inplace import beat_key, joined_key
from resilience.recovery.launch_config import LaunchConfig

log = logging.getLogger(__name__)
BEAT_S = 1.0  # how often a launcher raises its heartbeat counter
BEAT_LOST_S = 10.0  # a launcher whose counter stood this long is gone (its node lost whole)


class LostNodes:
    """One launcher's heartbeat, and on node 0 the watch on the others'."""

    def __init__(self, store: Any, config: LaunchConfig):
        self.store = store
        self.config = config
        self.beats: dict[int, tuple[int, float]] = {}  # each node's count, and when node 0 saw it move
        self.lost_at: float | None = None  # when this generation's silent nodes were found lost whole
        self._beat_at = 0.0

    def next_generation(self) -> None:
        """A new generation began: its silent nodes, if any, are judged afresh."""
        self.lost_at = None

    def beat(self) -> None:
        """Raise this node's counter, at most every ``BEAT_S``."""
        if time.monotonic() - self._beat_at >= BEAT_S:
            self._beat_at = time.monotonic()
            self.store.add(beat_key(self.config.node_rank), 1)

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
        """Whether node ``node``'s counter has not moved for ``BEAT_LOST_S``, as seen from here."""
        count = int(self.store.add(beat_key(node), 0))
        seen = self.beats.get(node)
        if seen is None or seen[0] != count:
            self.beats[node] = (count, now)
            return False
        return now - seen[1] >= BEAT_LOST_S
