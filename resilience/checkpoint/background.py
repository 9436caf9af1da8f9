"""The background half of saves, as one manager runs it: started, rested, restarted after a helper died.

``persist="process"``: a helper process per rank (they form a group of their own); ``"thread"``: writer and
uploader threads in this process. Either way the manager hands it a :class:`~resilience.persist.pipeline.WriteJob`
per save and learns of commits and failures from it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

from resilience.checkpoint.claim import RootClaim
from resilience.checkpoint.save_events import SaveEvents
from resilience.config import CheckpointConfig
from resilience.dist import Groups
from resilience.errors import CheckpointError
from resilience.persist import PersistPipeline
from resilience.persist.helper import (
    HelperGone,
    HelperPipeline,
    HelperSettings,
    call_in_helper,
    helper_log_level,
    helper_preload,
    start_store,
)
from resilience.persist.pipeline import Pipeline
from resilience.storage.tiers import DurableTier, LocalTier

log = logging.getLogger(__name__)
T = TypeVar("T")


class Background:
    """The pipeline a manager hands its saves to, and its life. Starting one is collective (helpers form a group)."""

    def __init__(
        self,
        config: CheckpointConfig,
        local: LocalTier,
        durable: DurableTier | None,
        groups: Groups,
        local_shared: bool,
        events: SaveEvents,
        roots: RootClaim,
        committed: Callable[[int], None],
        protected_steps: Callable[[], set[int]],
    ):
        self.config = config
        self.local = local
        self.durable = durable
        self.groups = groups
        self.local_shared = local_shared
        self.events = events
        self.roots = roots  # its heartbeat rests with the background: no thread of the pack runs while it rests
        self.committed = committed
        self.protected_steps = protected_steps
        self.generation = 0  # of helpers: each restart forms a new group
        self.resting = False  # ended by rest(); the next save starts a new one
        self._store: Any = None
        self._address: tuple[str, int] | None = None
        self.pipeline: PersistPipeline = self._start()

    def _start(self) -> PersistPipeline:
        """A helper process per rank (collective: they form a group), or threads."""
        topology = self.groups.topology
        if self.config.persist == "thread":
            return Pipeline(
                self.config,
                self.local,
                self.durable,
                topology,
                self.groups.writer,
                self.groups.upload,
                self.local_shared,
                self.events,
                self.committed,
                self.protected_steps,
            )
        if self._address is None:
            host, port, self._store = start_store(topology, self.groups.control)
            self._address = (host, port)
        settings = HelperSettings(
            config=self.config,
            topology=topology,
            local_shared=self.local_shared,
            store_host=self._address[0],
            store_port=self._address[1],
            generation=self.generation,
            log_level=helper_log_level(),
            preload=helper_preload(),
            environ=dict(os.environ),
            parent_pid=os.getpid(),
        )
        return HelperPipeline(settings, self.events, self.committed, self.protected_steps)

    def rest(self) -> None:
        """End what runs in the background (drained by the caller), and the roots' heartbeat, until the next save
        starts them again."""
        if not self.resting:
            self.pipeline.close()  # a helper is ended; threads have ended with their work, and are joined
            self.resting = True
            self.roots.pause()

    def ready(self) -> None:
        """Before a save: after a rest, every rank takes its roots back (or stops, if a live job took them) and
        starts a new group of helpers; a dead helper is restarted (collective)."""
        if self.resting:
            self.roots.resume()
            self.resting = False
            self.generation += 1
            self.pipeline = self._start()
        self._check_helpers()

    def stop(self) -> None:
        """Kill a helper at once (it may be stuck in a collective with a rank that is gone)."""
        if isinstance(self.pipeline, HelperPipeline) and not self.resting:
            self.pipeline.kill()

    def abandon(self) -> None:
        """End without a wait: a helper is killed; writer threads stuck in a collective with a lost rank are left
        to fail."""
        if isinstance(self.pipeline, HelperPipeline):
            self.stop()
        else:
            self.pipeline.close(0)

    def call(self, function: Callable[[], T]) -> T:
        """``function()`` (picklable) run off the training process, and waited for. In this rank's helper, beside
        its saves: no process to fork and no interpreter's pages to copy again. Where none runs (threads, or at
        rest) or it ends before it answers (killed for a restart), in a helper forked for the call, so
        ``function`` must be safe to run again (a name's write is: its file is whole or absent)."""
        pipeline = self.pipeline
        if isinstance(pipeline, HelperPipeline) and not self.resting:
            try:
                return cast(T, pipeline.call(function))
            except HelperGone as gone:
                log.info("%s; running it in a helper forked for it", gone)
        return cast(T, call_in_helper(function))

    def _check_helpers(self) -> None:
        """A helper died on some rank: every rank restarts its own (a new group), or all raise (collective)."""
        pipeline = self.pipeline
        dead = int(isinstance(pipeline, HelperPipeline) and pipeline.died is not None)
        if not self.groups.control.max([dead])[0]:
            return
        assert isinstance(pipeline, HelperPipeline)
        why = pipeline.died or "the checkpoint helper process of another rank died"
        if self.config.on_helper_death == "raise":
            raise CheckpointError(
                f"{why}: its saves were not committed; stopping (on_helper_death='raise'). Use "
                "on_helper_death='restart' to go on with new helpers, or persist='thread'"
            )
        log.warning("%s: the saves it held are not committed; restarting every rank's helper", why)
        pipeline.kill()
        self.pipeline.take_errors()  # the lost saves are reported above, not raised
        self.generation += 1
        self.pipeline = self._start()
