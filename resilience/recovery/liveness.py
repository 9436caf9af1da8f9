"""Who in the job is still alive, told without collectives: heartbeats and step-boundary states in a folder.

When a rank dies (kill -9, a lost node) or stops (SIGSTOP, a hang), collectives with it fail or never return,
so the survivors must learn who is gone, and what the dead rank's own state was (its RNG streams, its data
position), some other way. Every rank keeps a record in a folder all ranks see (the shared local tier): who it
is (host, pid, process start time), touched every ``interval_s`` by a small thread, and its per-rank state as of
its last step boundary, written by the same thread (the training thread only hands the captured values over).

A rank counts as lost when its process is gone (same host: the pid, and its start time, so a reused pid does
not count) or its heartbeat is older than ``stale_s`` (another host, or a stopped process).

The first survivor to find a rank lost posts a *rescue notice* here (the step it saves, and whom it found lost),
and every rank's heartbeat thread looks for it. A survivor whose own collectives never touch the lost rank (under
HSDP, one blocked in an all-reduce with another survivor that has left to save) learns of the loss that way,
not from a failed collective that would come only once the others give up and exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from resilience.checkpoint.tree import flatten, unflatten
from resilience.storage.processes import process_start_ticks
from resilience.storage.tiers import write_local_exclusive

log = logging.getLogger(__name__)


NOTICE_FILE = "rescue.json"


@dataclass(frozen=True)
class Notice:
    """A survivor's rescue notice: rank ``rank`` saves ``step`` among the ranks not in ``lost``."""

    rank: int
    step: int
    lost: frozenset[int]


class Liveness:
    """This rank's heartbeat and boundary state, and a view of the others'.

    Args:
        folder: Shared by all ranks of this job (and only this job: it is named by the job's token).
        rank: This process's global rank.
        world_size: Ranks in the job.
        interval_s: How often the heartbeat is touched (and the rescue notice looked for).
        on_notice: Called once, from the heartbeat thread, when a rescue notice appears.
    """

    def __init__(
        self,
        folder: str,
        rank: int,
        world_size: int,
        *,
        interval_s: float = 1.0,
        on_notice: Callable[[Notice], None] | None = None,
    ):
        self.folder = folder
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.on_notice = on_notice
        self._pending: tuple[int, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}.json")

    def _boundary(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank-{rank}.boundary.pt")

    @property
    def _notice_path(self) -> str:
        return os.path.join(self.folder, NOTICE_FILE)

    def start(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        pid = os.getpid()
        body = {"host": socket.gethostname(), "pid": pid, "start_ticks": process_start_ticks(pid), "rank": self.rank}
        tmp = self._record(self.rank) + ".tmp"
        with open(tmp, "w") as stream:
            json.dump(body, stream)
        os.replace(tmp, self._record(self.rank))
        self._thread = threading.Thread(target=self._beat, name="resilience-heartbeat", daemon=True)
        self._thread.start()

    def publish(self, step: int, rank_state: Any) -> None:
        """This rank's own state at the boundary after ``step`` (captured values), written at once by the
        heartbeat thread, so the training thread does not wait for the file."""
        with self._lock:
            self._pending = (step, rank_state)
        self._wake.set()

    def _beat(self) -> None:
        last = 0.0
        noticed = False
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is not None:
                self._write_boundary(*pending)
            if time.monotonic() - last >= self.interval_s:
                last = time.monotonic()
                with contextlib.suppress(OSError):
                    os.utime(self._record(self.rank))
                if not noticed and self.on_notice is not None:
                    notice = self.notice()
                    if notice is not None and notice.rank != self.rank:
                        noticed = True
                        self.on_notice(notice)

    def announce(self, step: int, lost: set[int]) -> Notice:
        """Post the rescue notice (this rank saves ``step`` without ``lost``), unless one is posted already; returns
        the notice in force, which every survivor follows, so that all of them save the same step with the same
        survivors. It appears whole or not at all, as a manifest does."""
        body = {"rank": self.rank, "step": step, "lost": sorted(lost)}
        with contextlib.suppress(FileExistsError):
            write_local_exclusive(self._notice_path, json.dumps(body).encode(), fsync=False)
        notice = self.notice()
        assert notice is not None, f"{self._notice_path} vanished"
        return notice

    def notice(self) -> Notice | None:
        """The rescue notice of this job, if a survivor posted one."""
        try:
            with open(self._notice_path) as stream:
                body = json.load(stream)
            return Notice(int(body["rank"]), int(body["step"]), frozenset(int(r) for r in body["lost"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # posted whole, so only a foreign file gets here
            log.warning("ignoring an unreadable rescue notice %s: %s", self._notice_path, exc)
            return None

    def _write_boundary(self, step: int, rank_state: Any) -> None:
        flat = flatten(rank_state)
        tmp = self._boundary(self.rank) + ".tmp"
        try:
            torch.save({"step": step, "skeleton": json.dumps(flat.skeleton), "tensors": flat.tensors}, tmp)
            os.replace(tmp, self._boundary(self.rank))
        except OSError as exc:  # a full disk must not stop training: only a survivor save would miss it
            log.debug("boundary state of rank %d not written: %s", self.rank, exc)

    def flush(self) -> None:
        """Write the latest boundary state now (before a survivor save reads it, or at the end)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._write_boundary(*pending)

    def lost(self, stale_s: float) -> set[int]:
        """Ranks whose process is gone or whose heartbeat is older than ``stale_s`` (never this rank)."""
        found: set[int] = set()
        now = time.time()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                with open(self._record(rank)) as stream:
                    body = json.load(stream)
                touched = os.stat(self._record(rank)).st_mtime
            except (OSError, ValueError):
                continue  # not started yet, or not written by this job: nothing to judge by
            if body.get("host") == socket.gethostname():
                ticks = process_start_ticks(int(body.get("pid", -1)))
                if ticks is None or (body.get("start_ticks") is not None and ticks != body["start_ticks"]):
                    found.add(rank)
                    continue
            if now - touched > stale_s:
                found.add(rank)
        return found

    def boundary_state(self, rank: int, allow_pickle: bool = False) -> tuple[int, Any] | None:
        """(step, per-rank state) as rank ``rank`` last published it, or None."""
        try:
            body = torch.load(self._boundary(rank), weights_only=True)
            state = unflatten(json.loads(body["skeleton"]), body["tensors"], allow_pickle=allow_pickle, where="")
        except Exception as exc:  # missing, torn by the kill, or from a rank that never reached a boundary
            log.info("no boundary state of rank %d: %s", rank, exc)
            return None
        return int(body["step"]), state

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2 * self.interval_s + 1)
        for path in (self._record(self.rank), self._boundary(self.rank)):
            with contextlib.suppress(OSError):
                os.unlink(path)
