"""ResiliencePlugin: settings from ``ACCELERATE_RESILIENCE_*`` and errors that name the fix."""

from __future__ import annotations

import pytest

from accelerate_resilience import ResiliencePlugin
from resilience.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith("ACCELERATE_RESILIENCE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_fields_default_from_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("ACCELERATE_RESILIENCE_LOCAL_ROOT", "/fast/ckpt")
    clean_env.setenv("ACCELERATE_RESILIENCE_DURABLE_URL", "s3://bucket/run")
    clean_env.setenv("ACCELERATE_RESILIENCE_STORAGE_OPTIONS", '{"endpoint_url": "http://127.0.0.1:9000"}')
    clean_env.setenv("ACCELERATE_RESILIENCE_EVERY_N_STEPS", "50")
    clean_env.setenv("ACCELERATE_RESILIENCE_KEEP_LAST", "4")
    clean_env.setenv("ACCELERATE_RESILIENCE_KEEP_EVERY", "1000")
    clean_env.setenv("ACCELERATE_RESILIENCE_ASYNC_STAGING", "off")
    clean_env.setenv("ACCELERATE_RESILIENCE_HEALTH", "1")
    clean_env.setenv("ACCELERATE_RESILIENCE_WHEN_BUSY", "skip")
    plugin = ResiliencePlugin()
    assert plugin.local_root == "/fast/ckpt"
    assert plugin.durable_url == "s3://bucket/run"
    assert plugin.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert (plugin.every_n_steps, plugin.keep_last, plugin.keep_every) == (50, 4, 1000)
    assert plugin.async_staging is False and plugin.health is True and plugin.when_busy == "skip"
    config = plugin.checkpoint_config()
    assert (config.local_root, config.durable_url, config.keep_last, config.async_staging) == (
        "/fast/ckpt",
        "s3://bucket/run",
        4,
        False,
    )
    assert "endpoint_url" not in repr(plugin), "storage options may hold credentials"


def test_arguments_beat_environment_and_defaults_apply(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("ACCELERATE_RESILIENCE_KEEP_LAST", "7")
    plugin = ResiliencePlugin(local_root="ckpt", keep_last=2)
    assert plugin.keep_last == 2 and plugin.from_env == {}
    assert (plugin.durable_url, plugin.every_n_steps, plugin.async_staging, plugin.health, plugin.when_busy) == (
        None,
        None,
        True,
        False,
        "wait",
    )
    assert plugin.storage_options == {} and plugin.storage_options is not ResiliencePlugin().storage_options


def test_persist_auto_is_what_the_job_comes_to_and_a_choice_stands(clean_env: pytest.MonkeyPatch) -> None:
    plugin = ResiliencePlugin(local_root="ckpt")
    assert plugin.persist == "auto"
    assert plugin.checkpoint_config(auto="thread").persist == "thread"
    assert plugin.checkpoint_config().persist == "process"  # until the models are known
    clean_env.setenv("ACCELERATE_RESILIENCE_PERSIST", "process")
    assert ResiliencePlugin(local_root="ckpt").checkpoint_config(auto="thread").persist == "process"


def test_goodput_and_auto_interval_fields_from_environment(clean_env: pytest.MonkeyPatch) -> None:
    plugin = ResiliencePlugin(local_root="ckpt")
    assert (plugin.goodput, plugin.run_dir, plugin.goodput_span_s) == (True, None, 10.0)
    assert (plugin.data_window_steps, plugin.starvation_threshold) == (50, 0.05)
    assert (plugin.mtbf_hours, plugin.min_interval_s, plugin.max_interval_s) == (None, 60.0, 21600.0)
    for name, value in {
        "EVERY_N_STEPS": "Auto",
        "MTBF_HOURS": "12.5",
        "MIN_INTERVAL_S": "30",
        "MAX_INTERVAL_S": "3600",
        "GOODPUT": "off",
        "RUN_DIR": "/shared/run",
        "GOODPUT_SPAN_S": "0",
        "DATA_WINDOW_STEPS": "20",
        "STARVATION_THRESHOLD": "0.1",
    }.items():
        clean_env.setenv(f"ACCELERATE_RESILIENCE_{name}", value)
    plugin = ResiliencePlugin(local_root="ckpt")
    assert (plugin.every_n_steps, plugin.mtbf_hours, plugin.min_interval_s, plugin.max_interval_s) == (
        "auto",
        12.5,
        30.0,
        3600.0,
    )
    assert (plugin.goodput, plugin.run_dir, plugin.goodput_span_s) == (False, "/shared/run", 0.0)
    assert (plugin.data_window_steps, plugin.starvation_threshold) == (20, 0.1)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("KEEP_LAST", "three", "ACCELERATE_RESILIENCE_KEEP_LAST='three' is not a whole number"),
        ("ASYNC_STAGING", "maybe", "ACCELERATE_RESILIENCE_ASYNC_STAGING='maybe' is not a boolean: use true/false"),
        ("STORAGE_OPTIONS", "{endpoint: x}", "ACCELERATE_RESILIENCE_STORAGE_OPTIONS is not valid JSON"),
        ("STORAGE_OPTIONS", '["a"]', "must be a JSON object of fsspec options, not a list"),
        ("KEEP_LAST", "1", "use keep_last >= 2 (set by ACCELERATE_RESILIENCE_KEEP_LAST)"),
        (
            "WHEN_BUSY",
            "later",
            "when_busy='later' is not one of 'wait', 'skip' (set by ACCELERATE_RESILIENCE_WHEN_BUSY)",
        ),
        (
            "PERSIST",
            "helper",
            "persist='helper' is not one of 'auto', 'process', 'thread' (set by ACCELERATE_RESILIENCE_PERSIST)",
        ),
        ("EVERY_N_STEPS", "0", "every_n_steps=0: use a positive number of optimizer steps, 'auto' or None (set by"),
        ("EVERY_N_STEPS", "often", "ACCELERATE_RESILIENCE_EVERY_N_STEPS='often' is not a whole number"),
        ("MTBF_HOURS", "soon", "ACCELERATE_RESILIENCE_MTBF_HOURS='soon' is not a number"),
        ("MAX_INTERVAL_S", "10", "0 < min_interval_s <= max_interval_s (set by ACCELERATE_RESILIENCE_MAX_INTERVAL_S)"),
        ("STARVATION_THRESHOLD", "5", "starvation_threshold=5.0: use a fraction of step time between 0 and 1"),
        ("DATA_WINDOW_STEPS", "0", "data_window_steps=0: use 1 or more (set by ACCELERATE_RESILIENCE_DATA_WINDOW"),
    ],
)
def test_bad_environment_values_name_the_variable(
    clean_env: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    clean_env.setenv(f"ACCELERATE_RESILIENCE_{variable}", value)
    with pytest.raises(ConfigError) as raised:
        ResiliencePlugin(local_root="ckpt")
    assert expected in str(raised.value)


def test_bad_arguments_are_rejected_when_made() -> None:
    with pytest.raises(ConfigError, match=r"verify='quick' is not one of 'auto', 'size', 'full'$"):
        ResiliencePlugin(local_root="ckpt", verify="quick")
    with pytest.raises(ConfigError, match="storage_options must be a dict"):
        ResiliencePlugin(local_root="ckpt", storage_options="endpoint=x")  # type: ignore[arg-type]


def test_the_old_name_local_dir_still_works_with_a_warning(clean_env: pytest.MonkeyPatch) -> None:
    """Job scripts written when the plugin called local_root local_dir (keyword or variable) keep working."""
    with pytest.warns(FutureWarning, match="local_dir is now local_root"):
        assert ResiliencePlugin(local_dir="ckpt").checkpoint_config().local_root == "ckpt"
    clean_env.setenv("ACCELERATE_RESILIENCE_LOCAL_DIR", "/fast/old")
    with pytest.warns(FutureWarning, match="ACCELERATE_RESILIENCE_LOCAL_DIR is now ACCELERATE_RESILIENCE_LOCAL_ROOT"):
        assert ResiliencePlugin().local_root == "/fast/old"
    with pytest.raises(ConfigError, match="local_dir is the old name of local_root; give only local_root"):
        ResiliencePlugin(local_root="/fast/new", local_dir="/fast/other")


def test_missing_local_root_says_how_to_give_one() -> None:
    plugin = ResiliencePlugin()
    with pytest.raises(ConfigError, match="set ACCELERATE_RESILIENCE_LOCAL_ROOT, or give the Accelerator a Project"):
        plugin.checkpoint_config()
    assert plugin.checkpoint_config(local_root="/proj/resilience", keep_last=5).keep_last == 5


def test_a_gpu_fault_drill_turns_nvml_on_also_without_cuda(clean_env: pytest.MonkeyPatch) -> None:
    """On CPU NVML is off (it would report another GPU), but a drill's GPU faults go through NVML's stand-in:
    ``ACCELERATE_RESILIENCE_HEALTH=1`` with ``RESILIENCE_INJECT="xid=79@..."`` must work with no code change."""
    assert not ResiliencePlugin().health_config(cuda=False).nvml
    clean_env.setenv("RESILIENCE_INJECT", "xid=79@step=3,rank=1")
    assert ResiliencePlugin().health_config(cuda=False).nvml
    clean_env.setenv("RESILIENCE_INJECT", "signal=SIGTERM@step=3")  # a signal needs no NVML
    assert not ResiliencePlugin().health_config(cuda=False).nvml
