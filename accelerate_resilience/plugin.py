"""The plugin dataclass: checkpoint settings for an Accelerate job, defaulting from ``ACCELERATE_RESILIENCE_*``.

``accelerate launch``'s YAML config rejects keys it does not know, so the environment is the one channel a
launcher, a SLURM script or a cluster template has to configure a third-party plugin without editing the
training script (:mod:`resilience.env_settings`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from resilience import env_settings as env
from resilience.config import CheckpointConfig, Persist, persist_until_known
from resilience.docstrings import documented_by
from resilience.errors import ConfigError
from resilience.goodput import GoodputConfig, IntervalConfig
from resilience.health import HealthConfig
from resilience.persist.fork_server import start_server_early
from resilience.recovery.peer_loss import PeerLossConfig

if TYPE_CHECKING:
    from resilience.session import TrainingSession

ENV_PREFIX = "ACCELERATE_RESILIENCE_"
DEFAULT_KEEP_LAST = 3
_ENGINE_NAMES = {"span_s": "goodput_span_s", "window_steps": "data_window_steps"}  # GoodputConfig's, these fields'


# The fields' documentation is the engine configs' (resilience.docstrings); what differs here is said here.
_OWN = {
    "health": "Watch GPU health (NVML, on CUDA), preemption signals (SIGTERM, SIGINT, SIGUSR1) and hangs; on a "
    "fault or signal every rank saves the same step and stops (see ``ResilienceHandle.should_stop``).",
    "local_dir": "The old name of ``local_root`` (keyword or variable): still read, with a warning.",
    "goodput": "Keep the run's goodput ledger (``resilience report RUN_DIR``): where the wall time went, across "
    "restarts. Only the main process writes it.",
}
_NOTES = {
    "storage_options": "In the variable: a JSON object.",
    "every_n_steps": "A save comes when the next batch is drawn, so the step, its scheduler step and the data "
    'position are complete; with ``"auto"`` the first comes 5 steps in, to measure C. Default: only when you '
    "call ``save()``.",
    "async_staging": "``accelerator.save_state()`` returns once the copy no longer reads the live state, as "
    "Accelerate's own does. For the saves of ``every_n_steps``, tensors changed elsewhere (a forward that updates "
    "buffers other than BatchNorm's, ``register_for_checkpointing`` objects) must not change before that step; "
    "turn it off for those.",
    "grace_s": "The same time bounds a survivor save after a lost peer.",
    "allow_pickle": "Off, a save refuses a ``register_for_checkpointing`` object whose state only pickle can store.",
    "persist": 'Or ``"auto"``: ``"thread"`` for one process with a model under 4 MiB, else ``"process"`` '
    "(:func:`resilience.config.auto_persist` says why).",
    "data_window_steps": "The figures are those of :meth:`ResilienceHandle.timed`.",
    # the defaults the plugin takes from the Accelerator (the others are shown from the fields)
    "local_root": "Default: ``<project_dir>/resilience`` when the Accelerator has a "
    "``ProjectConfiguration(project_dir=...)``.",
    "keep_last": "Default: the ``ProjectConfiguration``'s ``total_limit`` (raised to 2), else 3.",
    "run_dir": "Default: the ``ProjectConfiguration``'s ``project_dir``, else ``local_root`` itself (its parent may "
    "hold other runs).",
}
_RENAMED = {"survivor_saves": "enabled", **{v: k for k, v in _ENGINE_NAMES.items()}}


@documented_by(
    CheckpointConfig,
    IntervalConfig,
    GoodputConfig,
    HealthConfig,
    PeerLossConfig,
    own=_OWN,
    renamed=_RENAMED,
    notes=_NOTES,
    defaults=True,
)
@dataclass
class ResiliencePlugin:
    """How and where an Accelerate job checkpoints; pass it to :func:`accelerate_resilience.attach`.

    Every field left at ``None`` is read from ``ACCELERATE_RESILIENCE_<FIELD>`` (e.g.
    ``ACCELERATE_RESILIENCE_DURABLE_URL``), else takes the default shown.

    Args:
        local_root: Directory of the fast tier (node-local NVMe, or a shared file system). Each checkpoint is
            written to ``<local_root>/step-<N>/`` and counts once its ``manifest.json`` is there. Default:
            ``<project_dir>/resilience`` when the Accelerator has a ``ProjectConfiguration(project_dir=...)``.
        durable_url: Optional fsspec URL of the durable tier (``s3://bucket/run``, ``gs://...``, ``file:///...``,
            ``memory://...``). Committed local checkpoints are uploaded there in the background.
        storage_options: Keyword arguments for the durable tier's fsspec filesystem (``endpoint_url``, ``key``,
            ...). They are never written to logs, manifests or reports. In the variable: a JSON object.
        every_n_steps: Save every N optimizer steps (at steps that are multiples of N), ``"auto"`` for the
            Young/Daly interval ``sqrt(2 * C * MTBF)`` from the measured blocking cost C of a save, or None for no
            interval saves. A save comes when the next batch is drawn, so the step, its scheduler step and the data
            position are complete; with ``"auto"`` the first comes 5 steps in, to measure C. Default: only when you
            call ``save()``.
        keep_last: How many newest committed checkpoints each tier keeps (at least 2: the newest may still be
            uploading or be the one a crash interrupts). Default: the ``ProjectConfiguration``'s ``total_limit``
            (raised to 2), else 3.
        keep_every: Also keep every checkpoint whose step is a multiple of this (milestones).
        async_staging: Copy the state to host memory in the background. Until the copy is done, the next
            ``optimizer.step()`` (of any optimizer) first waits for it, through a global optimizer pre-step hook
            that exists only while a copy is pending; callers may also call ``wait_for_staging()`` themselves.
            ``accelerator.save_state()`` returns once the copy no longer reads the live state, as Accelerate's own
            does. For the saves of ``every_n_steps``, tensors changed elsewhere (a forward that updates buffers
            other than BatchNorm's, ``register_for_checkpointing`` objects) must not change before that step; turn
            it off for those. Default: true.
        when_busy: What a save does while the previous one is still being staged or written: ``"wait"`` for it, or
            ``"skip"`` the new one (counted and warned). Default: ``"wait"``.
        on_upload_error: ``"raise"`` stops training at the next save with the upload's error; ``"warn"`` keeps
            training on the local tier and logs the error. Default: ``"raise"``.
        verify: What discovery checks before it trusts a checkpoint: ``"size"`` (every file present with its size,
            and checksums of the small pickled/JSON files), ``"full"`` (checksums of every file), or ``"auto"``:
            full from the local tier (a flipped bit in a shard would otherwise load as a wrong number), except for
            shards this node hashed at commit and nothing has written, replaced or renamed since (its recorded inode
            and change time prove it; ``"full"`` hashes them anyway, for bits flipped underneath the file system);
            from the durable one sizes first, then each shard hashed as it is read, before DCP parses it (a full
            check first would download every shard twice). Default: ``"auto"``.
        fsync: Flush shards and manifest to stable storage before the local commit. Default: true.
        direct_io: Write shards to the local tier with ``O_DIRECT``, past the page cache, from a few reused aligned
            buffers (hashed as they go out, so the commit reads nothing back). A buffered write of the state costs
            the kernel page-cache pages to allocate and reclaim, seconds of system CPU per save at gigabytes, on the
            cores training uses. The price: a resume on the same node reads from the device, not from memory. Where
            the file system refuses ``O_DIRECT``, writes are buffered. Default: true.
        upload_concurrency: Files uploaded at once per rank. Default: 8.
        upload_retries: Attempts per file beyond the first before the upload fails. Default: 5.
        upload_backoff_s: First retry delay; doubles per attempt (with jitter), capped at 30 s. Default: 0.5.
        local_shared: Whether every rank sees the same ``local_root`` (auto: all ranks on one machine, with one
            directory; ranks that write to different directories are different nodes, whatever their hostnames).
        peer_copies: With node-local disks and a durable tier: after each durable commit, copy every rank's files
            into the memory of a server on the next node, so a node lost whole is restored from its peers rather
            than the durable tier. Costs each node, in host memory, its partner node's share of one checkpoint.
            Default: true.
        allow_pickle: Load state values that could only be saved as pickles. Off by default: a pickle from storage
            runs code when loaded. Off, a save refuses a ``register_for_checkpointing`` object whose state only
            pickle can store. Default: false.
        health: Watch GPU health (NVML, on CUDA), preemption signals (SIGTERM, SIGINT, SIGUSR1) and hangs; on a
            fault or signal every rank saves the same step and stops (see ``ResilienceHandle.should_stop``).
            Default: false.
        grace_s: Seconds from the fault (a stop signal's arrival) to the process's exit, whatever storage or the
            network does: the emergency save commits locally, its upload gets what is left but ``exit_reserve_s``,
            and an ``os._exit`` with the stop's code ends whatever still holds the process at the end (an upload cut
            short is done again by the next start). The default leaves 5 s of margin in the 30 s that SLURM
            (KillWait), Kubernetes (terminationGracePeriodSeconds) and torchrun's agent give between SIGTERM and
            SIGKILL; set it below your scheduler's. The same time bounds a survivor save after a lost peer. Default:
            25.
        survivor_saves: When a rank dies or hangs, the healthy ranks commit the last completed step from their
            replicas and exit (needs a local tier every rank sees). Default: true.
        persist: Where the background half of a save runs (DCP write, checksums, commit, upload, retention):
            ``"process"``, a helper process per rank reading the staged state from shared memory, so none of it
            competes with the training thread for the interpreter lock; or ``"thread"``, threads of the training
            process (no shared memory needed). Or ``"auto"``: ``"thread"`` for one process with a model under 4 MiB,
            else ``"process"`` (:func:`resilience.config.auto_persist` says why). Default: ``"auto"``.
        mtbf_hours: With ``"auto"``: the job's mean time between failures, if known; else observed from the run's
            restarts in its goodput ledger, else a prior of 5.8 GPU-years per GPU.
        min_interval_s: With ``"auto"``: the shortest interval it may choose. Default: 60.
        max_interval_s: With ``"auto"``: the longest interval it may choose. Default: 21600.
        goodput: Keep the run's goodput ledger (``resilience report RUN_DIR``): where the wall time went, across
            restarts. Only the main process writes it. Default: true.
        run_dir: Where the ledger lives (``<run_dir>/goodput/``); it must outlive a restart, and on several nodes be
            on a shared file system. Only the main process writes it. Default: the ``ProjectConfiguration``'s
            ``project_dir``, else ``local_root`` itself (its parent may hold other runs).
        goodput_span_s: How often the ledger writes what it has summed up as a span; between spans the pending one
            is kept in a side file at each step's end, so a kill loses only the time since the last step ended (it
            then shows as downtime). Default: 10.
        data_window_steps: Steps per data-wait window (one metrics row and at most one starvation warning each). The
            figures are those of :meth:`ResilienceHandle.timed`. Default: 50.
        starvation_threshold: Fraction of step time spent waiting for data above which the accelerator starves.
            Default: 0.05.
        local_dir: The old name of ``local_root`` (keyword or variable): still read, with a warning.
    """

    local_root: str | None = env.setting(None, env.text)
    durable_url: str | None = env.setting(None, env.text)
    storage_options: dict[str, Any] | None = env.setting({}, env.json_object, repr=False)
    every_n_steps: int | Literal["auto"] | None = env.setting(None, env.steps)
    keep_last: int | None = env.setting(None, env.integer)
    keep_every: int | None = env.setting(None, env.integer)
    async_staging: bool | None = env.setting(True, env.boolean)
    when_busy: str | None = env.setting("wait", env.text)
    on_upload_error: str | None = env.setting("raise", env.text)
    verify: str | None = env.setting("auto", env.text)
    fsync: bool | None = env.setting(True, env.boolean)
    direct_io: bool | None = env.setting(True, env.boolean)
    upload_concurrency: int | None = env.setting(8, env.integer)
    upload_retries: int | None = env.setting(5, env.integer)
    upload_backoff_s: float | None = env.setting(0.5, env.number)
    local_shared: bool | None = env.setting(None, env.boolean)
    peer_copies: bool | None = env.setting(True, env.boolean)
    allow_pickle: bool | None = env.setting(False, env.boolean)
    health: bool | None = env.setting(False, env.boolean)
    grace_s: float | None = env.setting(25.0, env.number)
    survivor_saves: bool | None = env.setting(True, env.boolean)
    persist: str | None = env.setting("auto", env.text)
    mtbf_hours: float | None = env.setting(None, env.number)
    min_interval_s: float | None = env.setting(60.0, env.number)
    max_interval_s: float | None = env.setting(6 * 3600.0, env.number)
    goodput: bool | None = env.setting(True, env.boolean)
    run_dir: str | None = env.setting(None, env.text)
    goodput_span_s: float | None = env.setting(10.0, env.number)
    data_window_steps: int | None = env.setting(50, env.integer)
    starvation_threshold: float | None = env.setting(0.05, env.number)
    local_dir: str | None = env.setting(None, env.text)
    from_env: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.from_env = env.fill_from_env(self, ENV_PREFIX)
        self._take_old_names()
        if not isinstance(self.storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options, not {type(self.storage_options)}")
        try:  # every setting is checked now, not at the first save
            self.interval_config()
            self.goodput_config(".")
            self.health_config(False)
        except ConfigError as exc:
            raise ConfigError(env.blame(str(exc), self.from_env, _ENGINE_NAMES)) from None
        if self.checkpoint_config(local_root=self.local_root or ".").persist == "process":
            start_server_early()

    def _take_old_names(self) -> None:
        """``local_dir``, this plugin's name for ``local_root`` before both adapters took the engine's: still read
        (keyword or variable), with a warning, so that job scripts written for it keep working."""
        if self.local_dir is None:
            return
        old = env.env_name(ENV_PREFIX, "local_dir") if "local_dir" in self.from_env else "local_dir"
        new = env.env_name(ENV_PREFIX, "local_root") if old != "local_dir" else "local_root"
        if self.local_root is not None and self.local_root != self.local_dir:
            raise ConfigError(
                f"ResiliencePlugin got local_root={self.local_root!r} and {old}={self.local_dir!r}: {old} is the old "
                f"name of local_root; give only {new}"
            )
        warnings.warn(
            f"ResiliencePlugin: {old} is now {new} (the name ResilientCheckpointIO takes too)",
            FutureWarning,
            stacklevel=4,
        )
        self.local_root, self.local_dir = self.local_dir, None

    def checkpoint_config(
        self, *, local_root: str | None = None, keep_last: int | None = None, auto: Persist = "process"
    ) -> CheckpointConfig:
        """The engine's settings; ``local_root`` and ``keep_last`` fill what this plugin leaves to the accelerator,
        ``auto`` what ``persist="auto"`` comes to for the prepared models (:func:`resilience.config.auto_persist`;
        ``"process"`` until they are known)."""
        root = self.local_root or local_root
        if not root:
            raise ConfigError(
                "ResiliencePlugin has no local_root: pass local_root=..., set "
                f"{env.env_name(ENV_PREFIX, 'local_root')}, "
                "or give the Accelerator a ProjectConfiguration(project_dir=...)"
            )
        try:
            return env.pick(
                CheckpointConfig,
                self,
                persist=auto if self.persist == "auto" else persist_until_known(str(self.persist)),
                local_root=root,
                durable_url=self.durable_url or None,
                storage_options=dict(self.storage_options or {}),
                keep_last=self.keep_last or keep_last or DEFAULT_KEEP_LAST,
            )
        except ConfigError as exc:
            raise ConfigError(env.blame(str(exc), self.from_env)) from None

    def interval_config(self) -> IntervalConfig:
        return env.pick(IntervalConfig, self)

    def goodput_config(self, run_dir: str) -> GoodputConfig:
        return env.pick(GoodputConfig, self, _ENGINE_NAMES, run_dir=run_dir)

    def configure(self, session: TrainingSession, *, run_dir: str, cuda: bool, health: HealthConfig | None) -> None:
        """Give ``session`` the parts these settings ask for: the goodput ledger in ``run_dir``, the save
        interval, survivor saves, and health monitoring (``health``, else the defaults when ``self.health``);
        collective, as health's set-up is. Every adapter over an Accelerator sets its session up alike."""
        if self.goodput:
            session.use_goodput(self.goodput_config(run_dir))
        session.use_interval(self.interval_config())
        session.use_peer_loss(PeerLossConfig(enabled=bool(self.survivor_saves), grace_s=float(self.grace_s or 0)))
        if health is not None or self.health:
            session.use_health(health or self.health_config(cuda))

    def health_config(self, cuda: bool) -> HealthConfig:
        """The defaults, with NVML watched only when the job runs on CUDA (NVML would report another GPU), or when
        a drill injects GPU faults (``RESILIENCE_INJECT``): they go through NVML's stand-in, on CPU too."""
        config = env.pick(HealthConfig, self, nvml=cuda)
        if not cuda and any(injection.kind is not None for injection in config.injections):
            config = env.pick(HealthConfig, self, nvml=True)
        return config
