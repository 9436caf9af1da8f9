"""Settings of the checkpoint engine, checked when they are made rather than at the first save."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from resilience.errors import ConfigError
from resilience.storage.layout import parse_step_dirname
from resilience.storage.tiers import DurableTier, LocalTier, Tier

if TYPE_CHECKING:
    import torch

WhenBusy = Literal["wait", "skip"]
VerifyLevel = Literal["auto", "size", "full"]
OnUploadError = Literal["raise", "warn"]
Persist = Literal["process", "thread"]
PersistSetting = Literal["auto", "process", "thread"]  # the adapters': "auto" is settled once the model is known
StagingBarrier = Literal["auto", "optimizer_step", "forward"]


@dataclass
class CheckpointConfig:
    """Where checkpoints go and how the background pipeline behaves.

    Args:
        local_root: Directory of the fast tier (node-local NVMe, or a shared file system). Each checkpoint is
            written to ``<local_root>/step-<N>/`` and counts once its ``manifest.json`` is there.
        durable_url: Optional fsspec URL of the durable tier (``s3://bucket/run``, ``gs://...``, ``file:///...``,
            ``memory://...``). Committed local checkpoints are uploaded there in the background.
        storage_options: Keyword arguments for the durable tier's fsspec filesystem (``endpoint_url``, ``key``,
            ...). They are never written to logs, manifests or reports.
        keep_last: How many newest committed checkpoints each tier keeps (at least 2: the newest may still be
            uploading or be the one a crash interrupts).
        keep_every: Also keep every checkpoint whose step is a multiple of this (milestones).
        when_busy: What a save does while the previous one is still being staged or written: ``"wait"`` for it,
            or ``"skip"`` the new one (counted and warned).
        async_staging: Copy the state to host memory in the background. Until the copy is done, the next
            ``optimizer.step()`` (of any optimizer) first waits for it, through a global optimizer pre-step hook
            that exists only while a copy is pending; callers may also call ``wait_for_staging()`` themselves.
        staging_barrier: Where that wait happens: ``"optimizer_step"`` (copy overlaps forward and backward;
            the torchtitan pattern), ``"forward"`` (before the next module forward, for models whose forward
            changes saved state, such as BatchNorm running statistics), or ``"auto"``: ``"forward"`` when the
            framework adapter sees such a module in the model, else ``"optimizer_step"``.
        pin_memory: Page-lock the host buffers (default: when the state holds CUDA tensors).
        fsync: Flush shards and manifest to stable storage before the local commit.
        direct_io: Write shards to the local tier with ``O_DIRECT``, past the page cache, from a few reused
            aligned buffers (hashed as they go out, so the commit reads nothing back). A buffered write of the
            state costs the kernel page-cache pages to allocate and reclaim, seconds of system CPU per save at
            gigabytes, on the cores training uses. The price: a resume on the same node reads from the device,
            not from memory. Where the file system refuses ``O_DIRECT``, writes are buffered.
        write_threads: Files per rank written in parallel by DCP.
        upload_concurrency: Files uploaded at once per rank.
        upload_retries: Attempts per file beyond the first before the upload fails.
        upload_backoff_s: First retry delay; doubles per attempt (with jitter), capped at 30 s.
        on_upload_error: ``"raise"`` stops training at the next save with the upload's error; ``"warn"`` keeps
            training on the local tier and logs the error.
        verify: What discovery checks before it trusts a checkpoint: ``"size"`` (every file present with its
            size, and checksums of the small pickled/JSON files), ``"full"`` (checksums of every file), or
            ``"auto"``: full from the local tier (a flipped bit in a shard would otherwise load as a wrong
            number), except for shards this node hashed at commit and nothing has written, replaced or renamed
            since (its recorded inode and change time prove it; ``"full"`` hashes them anyway, for bits flipped
            underneath the file system); from the durable one sizes first, then each shard hashed as it is read,
            before DCP parses it (a full check first would download every shard twice).
        allow_pickle: Load state values that could only be saved as pickles. Off by default: a pickle from
            storage runs code when loaded.
        collective_timeout_s: Timeout of the gloo groups the checkpoint collectives run on.
        local_shared: Whether every rank sees the same ``local_root`` (auto: all ranks on one machine, with one
            directory; ranks that write to different directories are different nodes, whatever their hostnames).
        peer_copies: With node-local disks and a durable tier: after each durable commit, copy every rank's files
            into the memory of a server on the next node, so a node lost whole is restored from its peers rather
            than the durable tier. Costs each node, in host memory, its partner node's share of one checkpoint.
        persist: Where the background half of a save runs (DCP write, checksums, commit, upload, retention):
            ``"process"``, a helper process per rank reading the staged state from shared memory, so none of it
            competes with the training thread for the interpreter lock; or ``"thread"``, threads of the
            training process (no shared memory needed).
        on_helper_death: With ``persist="process"``: when a rank's helper process dies, the next save
            ``"restart"`` s every rank's helper and goes on (the saves it held are failed, never committed), or
            ``"raise"`` s, stopping training with the cause.
    """

    local_root: str | os.PathLike[str]
    durable_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    keep_last: int = 3
    keep_every: int | None = None
    when_busy: WhenBusy = "wait"
    async_staging: bool = False
    staging_barrier: StagingBarrier = "auto"
    pin_memory: bool | None = None
    fsync: bool = True
    direct_io: bool = True
    write_threads: int = 1
    upload_concurrency: int = 8
    upload_retries: int = 5
    upload_backoff_s: float = 0.5
    on_upload_error: OnUploadError = "raise"
    verify: VerifyLevel = "auto"
    allow_pickle: bool = False
    collective_timeout_s: float = 600.0
    local_shared: bool | None = None
    peer_copies: bool = True
    persist: Persist = "process"
    on_helper_death: Literal["restart", "raise"] = "restart"

    def __post_init__(self) -> None:
        self.local_root = os.fspath(self.local_root)
        if not self.local_root:
            raise ConfigError("local_root is empty: give a directory for the fast checkpoint tier")
        if self.keep_last < 2:
            raise ConfigError(
                f"keep_last={self.keep_last} would leave no checkpoint while the newest is still being written "
                "or uploaded: use keep_last >= 2"
            )
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"keep_every={self.keep_every}: use a positive step count, or None for no milestones")
        _check_choice("when_busy", self.when_busy, ("wait", "skip"))
        _check_choice("verify", self.verify, ("auto", "size", "full"))
        _check_choice("staging_barrier", self.staging_barrier, ("auto", "optimizer_step", "forward"))
        _check_choice("on_upload_error", self.on_upload_error, ("raise", "warn"))
        _check_choice("persist", self.persist, ("process", "thread"))
        _check_choice("on_helper_death", self.on_helper_death, ("restart", "raise"))
        for name in ("write_threads", "upload_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: use 1 or more")
        if self.upload_retries < 0 or self.upload_backoff_s < 0 or self.collective_timeout_s <= 0:
            raise ConfigError(
                "upload_retries and upload_backoff_s must be >= 0 and collective_timeout_s > 0 "
                f"(got {self.upload_retries}, {self.upload_backoff_s}, {self.collective_timeout_s})"
            )

    def tiers(self) -> list[Tier]:
        """The tiers as storage, local first (no engine, no collectives: e.g. to look for checkpoints)."""
        tiers: list[Tier] = [LocalTier(self.local_root)]
        if self.durable_url:
            tiers.append(DurableTier(self.durable_url, self.storage_options))
        return tiers

    def locate(self, location: str | os.PathLike[str] | None, call: str) -> tuple[bool, int | None]:
        """Whether ``location`` names one of these tiers' roots (or a ``step-<N>`` folder in one), and that step.

        Frameworks' own save and load calls (``call``, for the error) take a folder; those naming this engine's
        are routed to it, as is a call with no folder. Any other URL is refused: frameworks would take it for a
        local folder, and this engine reads and writes only its own tiers.
        """
        if location is None:
            return True, None
        text = os.fspath(location).rstrip("/")
        roots = [os.fspath(self.local_root)] + ([self.durable_url.rstrip("/")] if self.durable_url else [])

        def same(path: str, root: str) -> bool:
            if "://" in path or "://" in root:
                return path == root
            return os.path.abspath(os.path.expanduser(path)) == os.path.abspath(root)

        if any(same(text, root) for root in roots):
            return True, None
        step = parse_step_dirname(text)
        parent = text.rsplit("/", 1)[0] if "/" in text else "."
        if step is not None and any(same(parent, root) for root in roots):
            return True, step
        if "://" in text:
            raise ConfigError(
                f"{call}({text!r}): the framework would write this URL as a local folder, and it is not this run's "
                f"durable_url ({self.durable_url}): set durable_url to it and call {call}() without a folder"
            )
        return False, None


# persist="auto": one process with a model smaller than this persists in threads (see auto_persist)
THREADS_BELOW_MODEL_BYTES = 4 * 2**20


def persist_until_known(persist: str) -> Persist:
    """The engine's ``persist`` for an adapter's setting before the model is known: ``"auto"`` stands for
    ``"process"`` until :func:`auto_persist` settles it (the helper's fork server starts early, as for
    ``"process"``: its interpreter takes seconds to import torch)."""
    _check_choice("persist", persist, ("auto", "process", "thread"))
    return "process" if persist == "auto" else cast(Persist, persist)


def auto_persist(modules: Iterable[torch.nn.Module], world_size: int) -> Persist:
    """What ``persist="auto"`` comes to: ``"thread"`` for one process whose model (parameters and buffers) is
    under :data:`THREADS_BELOW_MODEL_BYTES`, else ``"process"``.

    A helper process keeps a save's Python work (DCP's write, checksums, the commit) off the training thread:
    at this size a few milliseconds per save (a state of 16 MB or less with Adam's two moments). What it costs
    every run does not shrink with the model: an interpreter importing torch (1-2 s of CPU, more on a busy
    machine), which the first commit, and a name written before its save returns, wait for. Several processes
    keep their helpers whatever the model: a survivor ends its helper, which may be stuck in a collective with
    the lost rank; a thread cannot be ended.
    """
    model_bytes = sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))
    return auto_persist_for_bytes(model_bytes, world_size)


def auto_persist_for_bytes(model_bytes: int, world_size: int) -> Persist:
    """:func:`auto_persist` for a model known only by the bytes of its parameters and buffers (its state dict's)."""
    return "thread" if world_size == 1 and model_bytes < THREADS_BELOW_MODEL_BYTES else "process"


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
