"""The plugin dataclass: checkpoint settings for an Accelerate job, defaulting from ``ACCELERATE_RESILIENCE_*``.

``accelerate launch`` configures Accelerate's own plugins through environment variables that their
``__post_init__`` reads (``FullyShardedDataParallelPlugin`` reads ``FSDP_*``), and its YAML config rejects keys
it does not know. The environment is therefore the one channel a launcher, a SLURM script or a cluster
template can use to configure a third-party plugin without editing the training script; this plugin reads it
the same way: a field left at ``None`` takes its variable, else its default.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from resilience.config import CheckpointConfig
from resilience.errors import ConfigError
from resilience.health import HealthConfig
from resilience.session import GoodputConfig, IntervalConfig

ENV_PREFIX = "ACCELERATE_RESILIENCE_"
DEFAULT_KEEP_LAST = 3
AUTO = "auto"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _text(name: str, raw: str) -> str:
    return raw


def _integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number: set it to one, e.g. {name}=3") from None


def _number(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number: set it to one, e.g. {name}=0.5") from None


def _steps(name: str, raw: str) -> int | str:
    return AUTO if raw.strip().lower() == AUTO else _integer(name, raw)


def _boolean(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use true/false (or 1/0, yes/no, on/off)")


def _json_object(name: str, raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{name} is not valid JSON ({exc.msg} at position {exc.pos}): give a JSON object, "
            f'e.g. {name}=\'{{"endpoint_url": "http://127.0.0.1:9000"}}\''
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object of fsspec options, not a {type(value).__name__}")
    return value


def _env(default: Any, parse: Callable[[str, str], Any]) -> dict[str, Any]:
    """Field metadata: how ``__post_init__`` fills a field left at ``None`` (its variable, else ``default``)."""
    return {"default": default, "parse": parse}


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

    local_dir: str | None = field(default=None, metadata=_env(None, _text))
    durable_url: str | None = field(default=None, metadata=_env(None, _text))
    storage_options: dict[str, Any] | None = field(default=None, repr=False, metadata=_env({}, _json_object))
    every_n_steps: int | Literal["auto"] | None = field(default=None, metadata=_env(None, _steps))
    keep_last: int | None = field(default=None, metadata=_env(None, _integer))
    keep_every: int | None = field(default=None, metadata=_env(None, _integer))
    async_staging: bool | None = field(default=None, metadata=_env(True, _boolean))
    when_busy: str | None = field(default=None, metadata=_env("wait", _text))
    on_upload_error: str | None = field(default=None, metadata=_env("raise", _text))
    verify: str | None = field(default=None, metadata=_env("auto", _text))
    fsync: bool | None = field(default=None, metadata=_env(True, _boolean))
    upload_concurrency: int | None = field(default=None, metadata=_env(8, _integer))
    upload_retries: int | None = field(default=None, metadata=_env(5, _integer))
    upload_backoff_s: float | None = field(default=None, metadata=_env(0.5, _number))
    local_shared: bool | None = field(default=None, metadata=_env(None, _boolean))
    allow_pickle: bool | None = field(default=None, metadata=_env(False, _boolean))
    health: bool | None = field(default=None, metadata=_env(False, _boolean))
    grace_s: float | None = field(default=None, metadata=_env(25.0, _number))
    survivor_saves: bool | None = field(default=None, metadata=_env(True, _boolean))
    persist: str | None = field(default=None, metadata=_env("process", _text))
    mtbf_hours: float | None = field(default=None, metadata=_env(None, _number))
    min_interval_s: float | None = field(default=None, metadata=_env(60.0, _number))
    max_interval_s: float | None = field(default=None, metadata=_env(6 * 3600.0, _number))
    goodput: bool | None = field(default=None, metadata=_env(True, _boolean))
    run_dir: str | None = field(default=None, metadata=_env(None, _text))
    goodput_span_s: float | None = field(default=None, metadata=_env(10.0, _number))
    data_window_steps: int | None = field(default=None, metadata=_env(50, _integer))
    starvation_threshold: float | None = field(default=None, metadata=_env(0.05, _number))
    from_env: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _warn_unknown_variables({item.name for item in fields(self) if item.init})
        for item in fields(self):
            if not item.init or getattr(self, item.name) is not None:
                continue
            name = env_name(item.name)
            raw = os.environ.get(name, "").strip()
            if raw:
                setattr(self, item.name, item.metadata["parse"](name, raw))
                self.from_env[item.name] = name
            else:
                setattr(self, item.name, copy.deepcopy(item.metadata["default"]))
        if not isinstance(self.storage_options, dict):
            raise ConfigError(f"storage_options must be a dict of fsspec options, not {type(self.storage_options)}")
        self._check_ranges()
        self.checkpoint_config(local_dir=self.local_dir or ".")  # checks the rest now, not at the first save

    def checkpoint_config(self, *, local_dir: str | None = None, keep_last: int | None = None) -> CheckpointConfig:
        """The engine's settings; ``local_dir`` and ``keep_last`` fill what this plugin leaves to the accelerator."""
        root = self.local_dir or local_dir
        if not root:
            raise ConfigError(
                f"ResiliencePlugin has no local_dir: pass local_dir=..., set {env_name('local_dir')}, or give the "
                "Accelerator a ProjectConfiguration(project_dir=...)"
            )
        try:
            return CheckpointConfig(
                local_root=root,
                durable_url=self.durable_url or None,
                storage_options=dict(self.storage_options or {}),
                keep_last=self.keep_last or keep_last or DEFAULT_KEEP_LAST,
                keep_every=self.keep_every,
                when_busy=self.when_busy,  # type: ignore[arg-type]
                async_staging=bool(self.async_staging),
                on_upload_error=self.on_upload_error,  # type: ignore[arg-type]
                verify=self.verify,  # type: ignore[arg-type]
                allow_pickle=bool(self.allow_pickle),
                fsync=bool(self.fsync),
                upload_concurrency=int(self.upload_concurrency or 0),
                upload_retries=int(self.upload_retries if self.upload_retries is not None else 0),
                upload_backoff_s=float(self.upload_backoff_s if self.upload_backoff_s is not None else 0),
                local_shared=self.local_shared,
                persist=self.persist,  # type: ignore[arg-type]
            )
        except ConfigError as exc:
            raise ConfigError(self._blame(str(exc))) from None

    def interval_config(self) -> IntervalConfig:
        every = self.every_n_steps
        return IntervalConfig(
            every_n_steps=every,
            mtbf_hours=self.mtbf_hours,
            min_interval_s=float(self.min_interval_s or 0),
            max_interval_s=float(self.max_interval_s or 0),
        )

    def goodput_config(self, run_dir: str) -> GoodputConfig:
        return GoodputConfig(
            run_dir=run_dir,
            span_s=float(self.goodput_span_s or 0),
            window_steps=int(self.data_window_steps or 0),
            starvation_threshold=float(self.starvation_threshold or 0),
        )

    def health_config(self, cuda: bool) -> HealthConfig:
        """The defaults, with NVML watched only when the job runs on CUDA (NVML would report another GPU)."""
        return HealthConfig(nvml=cuda, grace_s=float(self.grace_s or 0))

    def _check_ranges(self) -> None:
        every, low, high = self.every_n_steps, self.min_interval_s, self.max_interval_s
        rules = (
            (
                "every_n_steps",
                every is None or every == AUTO or (isinstance(every, int) and every >= 1),
                "use a positive number of optimizer steps or 'auto', or leave it unset to save only when save() "
                "is called",
            ),
            ("mtbf_hours", self.mtbf_hours is None or self.mtbf_hours > 0, "use a positive number of hours"),
            ("min_interval_s", low is not None and low > 0, "use a positive number of seconds"),
            (
                "max_interval_s",
                high is not None and low is not None and high >= low,
                f"use at least min_interval_s ({low})",
            ),
            ("goodput_span_s", self.goodput_span_s is not None and self.goodput_span_s >= 0, "use 0 or more seconds"),
            ("grace_s", self.grace_s is not None and self.grace_s > 0, "use a positive number of seconds"),
            ("data_window_steps", self.data_window_steps is not None and self.data_window_steps >= 1, "use 1 or more"),
            (
                "starvation_threshold",
                self.starvation_threshold is not None and 0 < self.starvation_threshold < 1,
                "use a fraction of step time between 0 and 1, e.g. 0.05",
            ),
        )
        for name, valid, fix in rules:
            if not valid:
                raise ConfigError(self._blame(f"{name}={getattr(self, name)!r}: {fix}"))

    def _blame(self, message: str) -> str:
        """Name the environment variable behind a bad value: the fix is there, not in the script."""
        for name, variable in self.from_env.items():
            if message.startswith(f"{name}="):
                return f"{message} (set by {variable})"
        return message


def _warn_unknown_variables(known: set[str]) -> None:
    """An ``ACCELERATE_RESILIENCE_*`` variable no field reads is a typo that would silently do nothing."""
    names = {env_name(name): name for name in known}
    for variable in sorted(os.environ):
        if variable.startswith(ENV_PREFIX) and variable not in names:
            close = difflib.get_close_matches(variable, list(names), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else f"; the fields are {', '.join(sorted(names))}"
            warnings.warn(f"{variable} is not a ResiliencePlugin setting and is ignored{hint}", stacklevel=4)
