"""Split a state tree into tensors (saved through DCP) and a JSON skeleton (everything else).

DCP would pickle non-tensor values and turns integer dict keys into strings (an optimizer's ``state``
is keyed by ints and silently stops matching). Keeping the skeleton as tagged JSON preserves key types,
tuples, non-finite floats and the standard library's dates and times exactly, and means nothing but DCP's own
``.metadata`` is unpickled on load, unless a value could not be expressed in JSON and the user opts in with
``allow_pickle``.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from resilience.errors import ConfigError, CorruptCheckpointError

TAG = "$t"


@dataclass
class FlatState:
    """A state tree taken apart: ``tensors`` by checkpoint key, and the JSON-able rest."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    skeleton: Any = None
    pickled: list[str] = field(default_factory=list)


def _component(key: object) -> str:
    return str(key).replace("%", "%25").replace("/", "%2F")


def tree_key(*path: object) -> str:
    """The checkpoint key of the tensor at ``path`` in a saved tree (dict keys, list indices): ``a/b/0``."""
    return "/".join(_component(part) for part in path)


class _Flattener:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.out = FlatState()
        self.seen: dict[int, str] = {}

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {TAG: "float", "v": repr(value)}
        if isinstance(value, torch.Tensor):
            return {TAG: "tensor", "k": self._tensor(value, path)}
        if isinstance(value, np.ndarray) and value.dtype != object:
            return {TAG: "ndarray", "k": self._tensor(torch.from_numpy(np.ascontiguousarray(value)), path)}
        if isinstance(value, np.generic):
            return {TAG: "npscalar", "dtype": str(value.dtype), "v": self.encode(value.item(), path)}
        if isinstance(value, torch.Size):
            return {TAG: "size", "v": list(value)}
        if isinstance(value, tuple) and type(value) is tuple:
            return {TAG: "tuple", "v": [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            return self._mapping(value, path)
        if isinstance(value, (set, frozenset)):
            return {TAG: "set", "v": [self.encode(v, path) for v in sorted(value, key=repr)]}
        if isinstance(value, bytes):
            return {TAG: "bytes", "b64": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            return {TAG: "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {TAG: "device", "v": str(value)}
        when = _encode_time(value)
        if when is not None:
            return when
        self.out.pickled.append(path or "/")
        return {
            TAG: "pickle",
            "type": f"{type(value).__module__}.{type(value).__qualname__}",
            "b64": base64.b64encode(pickle.dumps(value)).decode(),
        }

    def _mapping(self, value: Mapping[Any, Any], path: str) -> Any:
        if all(isinstance(k, str) and k != TAG for k in value):
            return {k: self.encode(v, f"{path}/{_component(k)}") for k, v in value.items()}
        return {
            TAG: "dict",
            "items": [[self.encode(k, path), self.encode(v, f"{path}/{_component(k)}")] for k, v in value.items()],
        }

    def _tensor(self, tensor: torch.Tensor, path: str) -> str:
        known = self.seen.get(id(tensor))
        if known is not None:  # tied weights: one copy, two references
            return known
        key = f"{self.prefix}{path.lstrip('/')}" or "tensor"
        if key in self.out.tensors:
            raise ValueError(f"two entries of the state map to the checkpoint key {key!r}: rename one of them")
        self.out.tensors[key] = tensor
        self.seen[id(tensor)] = key
        return key


def flatten(tree: Any, prefix: str = "") -> FlatState:
    """Take ``tree`` apart; tensor keys are its paths joined by ``/``, after ``prefix``."""
    flattener = _Flattener(prefix)
    flattener.out.skeleton = flattener.encode(tree, "")
    return flattener.out


def tensor_keys(skeleton: Any, tags: tuple[str, ...] = ("tensor", "ndarray")) -> list[str]:
    """Every tensor key a skeleton refers to, in order; ``tags``: tensors, numpy arrays (stored as tensors), or both."""
    keys: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            if node.get(TAG) in tags:
                keys.append(node["k"])
            else:
                for item in node.values():
                    walk(item)

    walk(skeleton)
    return keys


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in a tree of dicts, lists and tuples (what a save of it writes, about)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor], *, allow_pickle: bool, where: str) -> Any:
    """Rebuild the tree; ``where`` names the checkpoint in errors."""

    def decode(node: Any) -> Any:
        if isinstance(node, list):
            return [decode(v) for v in node]
        if not isinstance(node, dict):
            return node
        tag = node.get(TAG)
        if tag is None:
            return {k: decode(v) for k, v in node.items()}
        if tag in ("tensor", "ndarray"):
            key = str(node.get("k"))
            if key not in tensors:
                raise CorruptCheckpointError(f"{where}: state refers to tensor {key!r}, which is not in the shards")
            return tensors[key] if tag == "tensor" else tensors[key].numpy()
        if tag == "float":
            return float(node["v"])
        if tag == "npscalar":
            return np.dtype(node["dtype"]).type(decode(node["v"]))
        if tag == "size":
            return torch.Size(node["v"])
        if tag == "tuple":
            return tuple(decode(v) for v in node["v"])
        if tag == "dict":
            return {_hashable(decode(k)): decode(v) for k, v in node["items"]}
        if tag == "set":
            return {_hashable(decode(v)) for v in node["v"]}
        if tag == "bytes":
            return base64.b64decode(node["b64"])
        if tag == "dtype":
            dtype = getattr(torch, str(node["v"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"{where}: {node['v']!r} in the saved state is not a torch dtype")
            return dtype
        if tag == "device":
            return torch.device(node["v"])
        if tag in _TIME_TAGS:
            return _decode_time(node)
        if tag == "pickle":
            if not allow_pickle:
                raise ConfigError(
                    f"{where} holds a pickled {node.get('type')} value; loading it would run code from storage. "
                    "Pass allow_pickle=True (or set RESILIENCE_ALLOW_PICKLE=1) if you trust this storage"
                )
            return pickle.loads(base64.b64decode(node["b64"]))
        raise CorruptCheckpointError(f"{where}: unknown value tag {tag!r} in the saved state")

    try:
        return decode(skeleton)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, RecursionError) as exc:  # a skeleton that no save could have written
        raise CorruptCheckpointError(f"{where}: the saved state is malformed ({type(exc).__name__}: {exc})") from exc


_TIME_TAGS = ("datetime", "date", "time", "timedelta")


def _encode_time(value: Any) -> dict[str, Any] | None:
    """A date, time, datetime or timedelta of the standard library (not a subclass: pandas' Timestamp is one), with
    no time zone or a fixed one; None for anything else. Users keep timestamps in the state they register."""
    kind = type(value)
    if kind is dt.timedelta:
        return {TAG: "timedelta", "v": _delta(value)}
    if kind is dt.date:
        return {TAG: "date", "v": value.isoformat()}
    if kind not in (dt.datetime, dt.time) or not (value.tzinfo is None or type(value.tzinfo) is dt.timezone):
        return None
    zone, tz = value.tzinfo, None
    if zone is not None:
        offset, name = zone.utcoffset(None), zone.tzname(None)
        tz = [*_delta(offset), None if name == dt.timezone(offset).tzname(None) else name]  # given, or the default
    return {TAG: kind.__name__, "v": value.replace(tzinfo=None).isoformat(), "fold": value.fold, "tz": tz}


def _delta(value: dt.timedelta) -> list[int]:
    return [value.days, value.seconds, value.microseconds]


def _decode_time(node: dict[str, Any]) -> Any:
    tag = node[TAG]
    if tag == "timedelta":
        days, seconds, microseconds = node["v"]
        return dt.timedelta(days=days, seconds=seconds, microseconds=microseconds)
    if tag == "date":
        return dt.date.fromisoformat(node["v"])
    kind = dt.datetime if tag == "datetime" else dt.time
    tzinfo = None
    if node["tz"] is not None:
        days, seconds, microseconds, name = node["tz"]
        offset = dt.timedelta(days=days, seconds=seconds, microseconds=microseconds)
        tzinfo = dt.timezone(offset) if name is None else dt.timezone(offset, name)
    return kind.fromisoformat(node["v"]).replace(tzinfo=tzinfo, fold=node["fold"])


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
