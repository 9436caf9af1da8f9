"""The plugin dataclass: checkpoint settings for an Accelerate job, defaulting from ``ACCELERATE_RESILIENCE_*``.

``accelerate launch``'s YAML config rejects keys it does not know, so the environment is the one channel a
launcher, a SLURM script or a cluster template has to configure a third-party plugin without editing the
training script (:mod:`resilience.env_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from resilience import env_settings as env
from resilience.config import CheckpointConfig
from resilience.errors import ConfigError
from resilience.health import HealthConfig
from resilience.session import GoodputConfig, IntervalConfig

ENV_PREFIX = "ACCELERATE_RESILIENCE_"
DEFAULT_KEEP_LAST = 3
_ENGINE_NAMES = {"span_s": "goodput_span_s", "window_steps": "data_window_steps"}  # GoodputConfig's, these fields'


def env_name(field_name: str) -> str:
    return env.env_name(ENV_PREFIX, field_name)


@dataclass
class ResiliencePlugin:
    """How and where an Accelerate job checkpoints; pass it to :func:`accelerate_resilience.attach`.

    Every field left at ``None`` is read from ``ACCELERATE_RESILIENCE_<FIELD>`` (e.g.
    ``ACCELERATE_RESILIENCE_DURABLE_URL``), else takes the default shown.

    Args:
        local_dir: Fast checkpoint tier (node-local disk or a shared file system). Default: ``<project_dir>/
            resilience`` when the Accelerator has a ``ProjectConfiguration(project_dir=...)``.
        durable_url: fsspec URL (``s3://bucket/run``, ``gs://...``) that committed checkpoints are uploaded to
            in the background, and that a resume on a fresh machine reads from. Default: none.
        storage_options: fsspec options for ``durable_url`` (endpoint, profile, ...); as JSON in the variable.
            Never logged.
        every_n_steps: Save automatically every N optimizer steps (when the next batch is drawn, so the step,
            its scheduler step and the data position are complete), or ``"auto"``: about ``sqrt(2 * C * MTBF)``
            seconds apart (Young/Daly), where ``C`` is the measured time a save blocks training, turned into
            steps with the measured step time; the first save comes 5 steps in, to measure ``C``. Default: only
            when you call ``save()``.
        mtbf_hours: With ``"auto"``: the job's mean time between failures, if known. Default: observed from the
            run's restarts in its goodput ledger, else a prior of 5.8 GPU-years per GPU.
        min_interval_s: With ``"auto"``: the shortest interval it may choose. Default: 60.
        max_interval_s: With ``"auto"``: the longest interval it may choose. Default: 21600 (6 hours).
        keep_last: Newest checkpoints kept per tier (at least 2). Default: the ``ProjectConfiguration``'s
            ``total_limit`` (raised to 2), else 3.
        keep_every: Also keep every checkpoint whose step is a multiple of this. Default: none.
        async_staging: Copy the state to host memory in the background too, so a save blocks for
            milliseconds and the copy overlaps the next forward and backward; it is waited for before the next
            optimizer step (and before a forward that updates BatchNorm statistics). Tensors changed elsewhere
            (a forward that updates other buffers, ``register_for_checkpointing`` objects) must not change
            before that step; turn it off for those. Default: true.
        when_busy: ``"wait"`` for the previous save, or ``"skip"`` this one while it is still being written.
        on_upload_error: ``"raise"`` stops training at the next save; ``"warn"`` trains on with the local tier.
        verify: What a resume checks before trusting a checkpoint: ``"auto"`` and ``"full"`` (every checksum
            of the copy it loads, from either tier), or ``"size"`` (sizes, and checksums of the small files).
        fsync: Flush files to stable storage before the local commit. Default: true.
        upload_concurrency: Files uploaded at once per rank. Default: 8.
        upload_retries: Retries per file (exponential backoff with jitter) before an upload fails. Default: 5.
        upload_backoff_s: First retry delay, doubling per attempt. Default: 0.5.
        local_shared: Whether every rank sees the same ``local_dir`` (a shared file system). Default: when all
            ranks are on one host.
        allow_pickle: Load state values that could only be stored as pickles (they run code when loaded).
        health: Watch GPU health (NVML, on CUDA), preemption signals (SIGTERM, SIGUSR1) and hangs; on a
            fault or signal every rank saves the same step and stops (see ``ResilienceHandle.should_stop``).
            Default: false.
        grace_s: Seconds from a fault (or a lost peer) until the process must be on its way out (the emergency
            or survivor save's local commit must fit, the upload gets what is left). Default: 25.
        survivor_saves: When a rank dies or hangs, the healthy ranks commit the last completed step from their
            replicas and exit 75 (needs a ``local_dir`` every rank sees). Default: true.
        persist: Where the background half of saves runs: ``"process"`` (a helper process per rank, reading
            the staged state from shared memory) or ``"thread"``. Default: ``"process"``.
        goodput: Keep the run's goodput ledger (``resilience report RUN_DIR``): where the wall time went,
            across restarts. Only the main process writes it. Default: true.
        run_dir: Where the ledger lives (``<run_dir>/goodput/``); it must outlive a restart, and on several
            nodes be on a shared file system. Default: the ``ProjectConfiguration``'s ``project_dir``, else
            ``local_dir`` itself (its parent may hold other runs).
        goodput_span_s: How often the ledger writes what it has summed up: a ``kill -9`` loses at most this
            much of the account (it then shows as downtime). Default: 10.
        data_window_steps: Steps per window of the data-wait figures of :meth:`ResilienceHandle.timed`
            (one metrics row and at most one starvation warning each). Default: 50.
        starvation_threshold: Fraction of step time spent waiting for data above which the accelerator is
            starving (a warning names the likely cause). Default: 0.05.
    """

    local_dir: str | None = env.setting(None, env.text)
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
    upload_concurrency: int | None = env.setting(8, env.integer)
    upload_retries: int | None = env.setting(5, env.integer)
    upload_backoff_s: float | None = env.setting(0.5, env.number)
    local_shared: bool | None = env.setting(None, env.boolean)
    allow_pickle: bool | None = env.setting(False, env.boolean)
    health: bool | None = env.setting(False, env.boolean)
    grace_s: float | None = env.setting(25.0, env.number)
    survivor_saves: bool | None = env.setting(True, env.boolean)
    persist: str | None = env.setting("process", env.text)
    mtbf_hours: float | None = env.setting(None, env.number)
    min_interval_s: float | None = env.setting(60.0, env.number)
    max_interval_s: float | None = env.setting(6 * 3600.0, env.number)
    goodput: bool | None = env.setting(True, env.boolean)
    run_dir: str | None = env.setting(None, env.text)
    goodput_span_s: float | None = env.setting(10.0, env.number)
    data_window_steps: int | None = env.setting(50, env.integer)
    starvation_threshold: float | None = env.setting(0.05, env.number)
    from_env: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.from_env = env.fill_from_env(self, ENV_PREFIX)
        if not isinstance(self.storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options, not {type(self.storage_options)}")
        try:  # every setting is checked now, not at the first save
            self.interval_config()
            self.goodput_config(".")
            self.health_config(False)
        except ConfigError as exc:
            raise ConfigError(env.blame(str(exc), self.from_env, _ENGINE_NAMES)) from None
        self.checkpoint_config(local_dir=self.local_dir or ".")

    def checkpoint_config(self, *, local_dir: str | None = None, keep_last: int | None = None) -> CheckpointConfig:
        """The engine's settings; ``local_dir`` and ``keep_last`` fill what this plugin leaves to the accelerator."""
        root = self.local_dir or local_dir
        if not root:
            raise ConfigError(
                f"ResiliencePlugin has no local_dir: pass local_dir=..., set {env_name('local_dir')}, or give the "
                "Accelerator a ProjectConfiguration(project_dir=...)"
            )
        try:
            return env.pick(
                CheckpointConfig,
                self,
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

    def health_config(self, cuda: bool) -> HealthConfig:
        """The defaults, with NVML watched only when the job runs on CUDA (NVML would report another GPU)."""
        return env.pick(HealthConfig, self, nvml=cuda)
