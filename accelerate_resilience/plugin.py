"""The plugin dataclass: checkpoint settings for an Accelerate job, defaulting from ``ACCELERATE_RESILIENCE_*``.

``accelerate launch``'s YAML config rejects keys it does not know, so the environment is the one channel a
launcher, a SLURM script or a cluster template has to configure a third-party plugin without editing the
training script (:mod:`resilience.env_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from resilience import env_settings as env
from resilience.config import CheckpointConfig, Persist, persist_until_known
from resilience.docstrings import document
from resilience.errors import ConfigError
from resilience.goodput import GoodputConfig, IntervalConfig
from resilience.health import HealthConfig
from resilience.persist.helper import start_server_early
from resilience.recovery.peer_loss import PeerLossConfig

ENV_PREFIX = "ACCELERATE_RESILIENCE_"
DEFAULT_KEEP_LAST = 3
_ENGINE_NAMES = {"span_s": "goodput_span_s", "window_steps": "data_window_steps"}  # GoodputConfig's, these fields'


# The fields' documentation is the engine configs' (resilience.docstrings); what differs here is said here.
_OWN = {
    "health": "Watch GPU health (NVML, on CUDA), preemption signals (SIGTERM, SIGINT, SIGUSR1) and hangs; on a "
    "fault or signal every rank saves the same step and stops (see ``ResilienceHandle.should_stop``).",
    "goodput": "Keep the run's goodput ledger (``resilience report RUN_DIR``): where the wall time went, across "
    "restarts. Only the main process writes it.",
}
_NOTES = {
    "storage_options": "In the variable: a JSON object.",
    "every_n_steps": "A save comes when the next batch is drawn, so the step, its scheduler step and the data "
    'position are complete; with ``"auto"`` the first comes 5 steps in, to measure C. Default: only when you '
    "call ``save()``.",
    "async_staging": "Tensors changed elsewhere (a forward that updates buffers other than BatchNorm's, "
    "``register_for_checkpointing`` objects) must not change before that step; turn it off for those.",
    "grace_s": "The same time bounds a survivor save after a lost peer.",
    "persist": 'Or ``"auto"``: ``"thread"`` for one process with a model under 4 MiB, else ``"process"`` '
    "(:func:`resilience.config.auto_persist` says why).",
    "data_window_steps": "The figures are those of :meth:`ResilienceHandle.timed`.",
    # the defaults the plugin takes from the Accelerator (the others are shown from the fields)
    "local_dir": "Default: ``<project_dir>/resilience`` when the Accelerator has a "
    "``ProjectConfiguration(project_dir=...)``.",
    "keep_last": "Default: the ``ProjectConfiguration``'s ``total_limit`` (raised to 2), else 3.",
    "run_dir": "Default: the ``ProjectConfiguration``'s ``project_dir``, else ``local_dir`` itself (its parent may "
    "hold other runs).",
}
_RENAMED = {"local_dir": "local_root", "survivor_saves": "enabled", **{v: k for k, v in _ENGINE_NAMES.items()}}


@document(
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
    direct_io: bool | None = env.setting(True, env.boolean)
    upload_concurrency: int | None = env.setting(8, env.integer)
    upload_retries: int | None = env.setting(5, env.integer)
    upload_backoff_s: float | None = env.setting(0.5, env.number)
    local_shared: bool | None = env.setting(None, env.boolean)
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
        if self.checkpoint_config(local_dir=self.local_dir or ".").persist == "process":
            start_server_early()

    def checkpoint_config(
        self, *, local_dir: str | None = None, keep_last: int | None = None, auto: Persist = "process"
    ) -> CheckpointConfig:
        """The engine's settings; ``local_dir`` and ``keep_last`` fill what this plugin leaves to the accelerator,
        ``auto`` what ``persist="auto"`` comes to for the prepared models (:func:`resilience.config.auto_persist`;
        ``"process"`` until they are known)."""
        root = self.local_dir or local_dir
        if not root:
            raise ConfigError(
                f"ResiliencePlugin has no local_dir: pass local_dir=..., set {env.env_name(ENV_PREFIX, 'local_dir')}, "
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

    def health_config(self, cuda: bool) -> HealthConfig:
        """The defaults, with NVML watched only when the job runs on CUDA (NVML would report another GPU), or when
        a drill injects GPU faults (``RESILIENCE_INJECT``): they go through NVML's stand-in, on CPU too."""
        config = env.pick(HealthConfig, self, nvml=cuda)
        if not cuda and any(injection.kind is not None for injection in config.injections):
            config = env.pick(HealthConfig, self, nvml=True)
        return config
