"""Settings read from environment variables: a dataclass field left at ``None`` takes its variable, else its default.

Launchers (``accelerate launch``, torchrun, a SLURM script, a cluster template) can set a process's environment
but not the arguments of an object the training script builds; Accelerate's own plugins read their settings
this way (``FullyShardedDataParallelPlugin`` reads ``FSDP_*``). A variable under the prefix that no field reads
is a typo that would silently do nothing, so it is warned about with the closest name.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import field, fields
from typing import Any, TypeVar

from resilience.errors import ConfigError

Parse = Callable[[str, str], Any]  # (variable name, raw text) -> value, raising ConfigError that names the fix
AUTO = "auto"
C = TypeVar("C")


def text(name: str, raw: str) -> str:
    return raw


def integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number: set it to one, e.g. {name}=3") from None


def number(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number: set it to one, e.g. {name}=0.5") from None


def steps(name: str, raw: str) -> int | str:
    """A step count, or ``"auto"``."""
    return AUTO if raw.strip().lower() == AUTO else integer(name, raw)


def boolean(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use true/false (or 1/0, yes/no, on/off)")


def json_object(name: str, raw: str) -> dict[str, Any]:
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


def setting(default: Any, parse: Parse, **kwargs: Any) -> Any:
    """A dataclass field that :func:`fill_from_env` fills when it is left at ``None``."""
    return field(default=None, metadata={"default": default, "parse": parse}, **kwargs)


def env_name(prefix: str, field_name: str) -> str:
    return prefix + field_name.upper()


def fill_from_env(settings: Any, prefix: str) -> dict[str, str]:
    """Fill ``settings``' fields left at ``None`` from ``<prefix><FIELD>``, else their defaults; returns which
    fields came from which variable (so that an error can name the variable to fix, :func:`blame`)."""
    known = {env_name(prefix, item.name): item.name for item in fields(settings) if "parse" in item.metadata}
    for variable in sorted(os.environ):
        if variable.startswith(prefix) and variable not in known:
            close = difflib.get_close_matches(variable, list(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else f"; the fields are {', '.join(sorted(known))}"
            warnings.warn(f"{variable} is not a {type(settings).__name__} setting and is ignored{hint}", stacklevel=4)
    from_env = {}
    for variable, name in known.items():
        if getattr(settings, name) is not None:
            continue
        item = settings.__dataclass_fields__[name]
        raw = os.environ.get(variable, "").strip()
        if raw:
            setattr(settings, name, item.metadata["parse"](variable, raw))
            from_env[name] = variable
        else:
            setattr(settings, name, copy.deepcopy(item.metadata["default"]))
    return from_env


def pick(config: type[C], settings: Any, aliases: Mapping[str, str] | None = None, **given: Any) -> C:
    """A ``config`` dataclass from ``given`` and the settings' fields (or a mapping's items: an adapter's
    arguments) of the same names (``aliases``: the config's name -> the settings' name) that are set (not None);
    what neither has keeps the config's default."""
    values = {}
    for item in fields(config):  # type: ignore[arg-type]
        name = (aliases or {}).get(item.name, item.name)
        value = settings.get(name) if isinstance(settings, Mapping) else getattr(settings, name, None)
        if item.init and value is not None:
            values[item.name] = value
    return config(**{**values, **given})


def blame(message: str, from_env: dict[str, str], aliases: dict[str, str] | None = None) -> str:
    """Name the environment variable behind a bad value (``<field>=...`` in ``message``): the fix is there, not in
    the script. ``aliases``: the settings' names of fields the message names as the engine calls them."""
    for engine_name, own in (aliases or {}).items():
        message = re.sub(rf"(?<!\w){engine_name}=", f"{own}=", message)
    named = [variable for name, variable in from_env.items() if re.search(rf"(?<!\w){name}=", message)]
    return f"{message} (set by {', '.join(named)})" if named else message
