"""A committed checkpoint as ordinary files: the bridge to tools that know ``torch.load`` or safetensors.

The step directories stay the source of truth. :func:`read_committed` reads a whole step back in this process
(no process group: every shard, whoever wrote it). :func:`export` writes a step in another format (a Lightning
``.ckpt``, a ``torch.save`` state dict, Hugging Face safetensors), checksums first, streaming a few tensors at a
time (``step_reader``), so a state larger than memory can be exported; :func:`write_name` makes a Lightning name
the same way. Every file is written atomically: a reader sees the old file or the whole new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import torch
from fsspec.core import url_to_fs

from resilience.checkpoint.loader import Restored, plan_load, run_load
from resilience.checkpoint.step_reader import DEFAULT_BUDGET_BYTES, StepReader
from resilience.checkpoint.tree import tree_key
from resilience.errors import ConfigError, NoCheckpointError
from resilience.formats import SUFFIXES, check_suffix, lightning_ckpt, safetensors_file
from resilience.formats.safetensors_file import DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, index, plan_shards, write_shard
from resilience.formats.torch_file import write_torch_file
from resilience.storage import catalog
from resilience.storage.layout import STATE_FILE, rank_state_file
from resilience.storage.tiers import Tier

FORMATS = ("lightning", "torch", "safetensors")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METADATA_KEY = "training-resilience"  # in every file made from an engine step: which run and step it came from
# Where each adapter keeps what an export takes, as paths in the shared state tree (docs/FORMAT.md).
LAYOUTS: dict[str, dict[str, str]] = {
    "lightning": {"model": "state_dict", "optimizers": "optimizer_states", "schedulers": "lr_schedulers"},
    "accelerate": {
        "model": "training/models/{model}",
        "optimizers": "training/optimizers",
        "schedulers": "training/schedulers",
    },
}


@dataclass
class Exported:
    """What :func:`export` wrote."""

    step: int
    format: str
    files: list[str] = field(default_factory=list)
    tensor_bytes: int = 0
    note: str | None = None  # what the caller should tell the user: e.g. a file name that became a directory


def export(
    source: str,
    out: str,
    *,
    format: str,
    step: int | None = None,
    weights_only: bool = False,
    dtype: torch.dtype | None = None,
    model: int = 0,
    weights: str | None = None,
    storage_options: dict[str, Any] | None = None,
    out_storage_options: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    overwrite: bool = False,
    allow_pickle: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> Exported:
    """Write committed step ``step`` (default: the newest) of ``source`` to ``out`` in ``format``.

    Args:
        source: A checkpoint root (a run's ``local_root`` or ``durable_url``) or one ``step-<N>`` folder of it.
        out: The file to write; a path or URL. safetensors: a ``.safetensors`` name is one file (a directory
            of shards beside it, named without the suffix, when the weights exceed ``max_shard_bytes``: see
            ``Exported.note``); any other name is a directory in ``save_pretrained``'s layout.
        format: ``lightning``: the ``.ckpt`` dict the Lightning adapter's names hold (Lightning runs only).
            ``torch``: the model's state dict (``weights_only``), else ``{"step", "model", "optimizers",
            "schedulers"}`` (``{"step", "state"}``, the whole tree, for a state the engine saved directly).
            ``safetensors``: the model's weights, ``save_pretrained``'s file layout.
        weights_only: Leave out optimizer, scheduler and callback state (safetensors always does).
        dtype: Cast the model's floating-point weights (not optimizer state) to this dtype, e.g. bfloat16.
        model: Which of an Accelerate run's prepared models (in ``prepare`` order).
        weights: The path in the saved state of the model's state dict (``a/b/c``); needed for a state saved
            by the engine directly, which records no adapter.
        max_shard_bytes: safetensors: the largest file before the weights are split (``5GB``, as HF).
        budget_bytes: The most tensor bytes held in memory at once.
        overwrite: Replace what an earlier export wrote at ``out``.
    """
    if format not in FORMATS:
        raise ConfigError(f"format={format!r} is not one of {', '.join(FORMATS)}")
    check_suffix(out, format)
    tier, folder_step = catalog.open_root(source, storage_options)
    entry = _committed_entry(tier, step if step is not None else folder_step)
    assert entry.manifest is not None
    catalog.verify(entry, full=True)
    reader = StepReader(entry, allow_pickle=allow_pickle, budget_bytes=budget_bytes, on_bytes=on_bytes)
    contents = _Contents(reader, entry, reader.tree(STATE_FILE), model, weights, weights_only, dtype)
    origin = {"step": entry.step, "run_id": entry.manifest.run_id, "source": tier.display(entry.path)}
    done = Exported(entry.step, format)
    if format == "safetensors":
        named = contents.model_weights()
        _write_safetensors(named, out, reader, origin, done, max_shard_bytes, overwrite, out_storage_options)
        return done
    obj = contents.lightning_dict() if format == "lightning" else contents.torch_dict()
    if format == "lightning" or not weights_only:  # a bare state dict has none: load_state_dict(strict=True)
        obj[METADATA_KEY] = origin
    with atomic_output(out, storage_options=out_storage_options, overwrite=overwrite) as stream:
        done.tensor_bytes = write_torch_file(obj, stream, reader)
    done.files.append(out)
    return done


def write_name(
    tier: Tier,
    step: int,
    out: str,
    keys: list[str],
    extra: dict[str, Any],
    *,
    verify: bool,
    allow_pickle: bool,
    storage_options: dict[str, Any] | None = None,
    held: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write the Lightning ``.ckpt`` of committed step ``step`` holding the top-level ``keys`` (and ``extra``).

    Streamed as :func:`export` streams: the training process that writes a name holds a few tensors of the step
    at a time, never a second copy of the whole state. ``verify``: checksum every file first (skip it only for
    a step this process has just written and hashed). ``held``: tensors of the step still in memory (the
    staging buffers it was written from), by DCP key, written from there instead of read back.
    """
    entry = committed_entry(tier, step, verify=verify)
    reader = StepReader(entry, allow_pickle=allow_pickle, held=held)
    checkpoint = _Contents(reader, entry, reader.tree(STATE_FILE), 0, None, False, None).lightning_dict(keys)
    checkpoint.update(extra)
    with atomic_output(out, storage_options=storage_options) as stream:
        write_torch_file(checkpoint, stream, reader)


def dcp_keys(state_dict: Mapping[str, torch.Tensor], under: str) -> dict[str, torch.Tensor]:
    """``state_dict`` keyed as the engine's DCP files name it, for a plain ``dcp.load`` of a step folder.

    The engine names a tensor by its path in the saved tree, joined with ``/`` (``state_dict/net.0.weight``),
    where DCP would join nested keys with ``.``; see docs/FORMAT.md. ``under`` is the path of the state dict:
    ``state_dict`` for Lightning, ``training/models/0`` for Accelerate's first model.
    """
    return {f"{under}/{tree_key(name)}": tensor for name, tensor in state_dict.items()}


# ---- what each format holds -----------------------------------------------------------------------------------


@dataclass
class _Contents:
    """One step's state, with placeholders, and what the caller asked of it."""

    reader: StepReader
    entry: catalog.Entry
    state: Any
    model: int
    weights: str | None
    weights_only: bool
    dtype: torch.dtype | None

    @property
    def adapter(self) -> Any:
        assert self.entry.manifest is not None
        return self.entry.manifest.extra.get("adapter")

    @property
    def step(self) -> int:
        return self.entry.step

    def lightning_dict(self, keys: list[str] | None = None) -> dict[str, Any]:
        """The ``.ckpt`` dict (Lightning Fabric's: the dict given to ``fabric.save``); ``keys``: its top-level keys
        (a name's, as its save asked), default all saved."""
        if self.adapter not in ("lightning", "fabric") or not isinstance(self.state, dict):
            raise ConfigError(
                f"{self.entry.where()} was saved by {_saver(self.adapter)}, not Lightning: a .ckpt is made from a "
                "Lightning run's checkpoint; export this one with --format torch or --format safetensors"
            )
        assert self.entry.manifest is not None
        keys = list(self.state) if keys is None else keys
        if self.weights_only:
            keys = lightning_ckpt.weights_only_keys(keys)
        rank0 = self.reader.tree(rank_state_file(0)) if self.entry.manifest.file(rank_state_file(0)) else None
        checkpoint = lightning_ckpt.as_name(self.state, rank0, keys)
        if isinstance(checkpoint.get("state_dict"), dict):
            checkpoint["state_dict"] = self._cast(checkpoint["state_dict"])
        return checkpoint

    def torch_dict(self) -> Any:
        layout = LAYOUTS.get(str(self.adapter))
        if layout is None and self.weights is None and not self.weights_only and self.dtype is None:
            return {"step": self.step, "state": self.state}  # the engine's own tree, as it was saved
        weights = dict(self.model_weights())
        if self.weights_only:
            return weights
        return {
            "step": self.step,
            "model": weights,
            "optimizers": self._at(layout["optimizers"]) if layout else [],
            "schedulers": self._at(layout["schedulers"]) if layout else [],
        }

    def model_weights(self) -> list[tuple[str, Any]]:
        """The model's state dict as (name, tensor) pairs, in saved order, floating tensors cast to ``dtype``."""
        path = self.weights
        if path is None:
            layout = LAYOUTS.get(str(self.adapter))
            if layout is None:
                raise ConfigError(
                    f"step {self.step} was saved by {_saver(self.adapter)}, which records no model: name the state "
                    "dict in the saved state with --weights PATH (weights=...), e.g. --weights model"
                )
            if self.adapter == "accelerate":
                count = len(self._at("training/models"))
                if not 0 <= self.model < count:
                    raise ConfigError(
                        f"step {self.step} holds {count} model(s): choose one with --model 0..{count - 1}"
                    )
            path = layout["model"].format(model=self.model)
        found = self._at(path)
        if not isinstance(found, Mapping) or not all(isinstance(name, str) for name in found):
            raise ConfigError(f"{path!r} in step {self.step} is not a state dict (names to tensors): give --weights")
        return list(self._cast(dict(found)).items())

    def _cast(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        dtype, reader = self.dtype, self.reader
        if dtype is None:
            return state_dict
        return {
            name: reader.cast(value, dtype)
            if reader.is_placeholder(value) and value.is_floating_point() and value.dtype != dtype
            else value
            for name, value in state_dict.items()
        }

    def _at(self, path: str) -> Any:
        """The value at ``path`` (``a/b/0``: keys and list indices, ``%2F`` for a ``/`` in a key) of the state."""
        node = self.state
        for part in path.strip("/").split("/"):
            name = part.replace("%2F", "/").replace("%25", "%")
            if isinstance(node, Mapping) and name in node:
                node = node[name]
            elif isinstance(node, (list, tuple)) and name.isdigit() and int(name) < len(node):
                node = node[int(name)]
            else:
                raise ConfigError(f"step {self.step} has nothing at {path!r} (no {name!r} there): check the path")
        return node


def _saver(adapter: Any) -> str:
    return f"the {adapter} adapter" if adapter else "the engine directly"


# ---- safetensors ---------------------------------------------------------------------------------------------


def _write_safetensors(
    named: list[tuple[str, Any]],
    out: str,
    reader: StepReader,
    origin: dict[str, Any],
    done: Exported,
    max_shard_bytes: int,
    overwrite: bool,
    options: dict[str, Any] | None,
) -> None:
    """``out`` ending in ``.safetensors`` is one file, which ``safetensors.torch.load_file`` reads; weights
    larger than ``max_shard_bytes`` go to the directory of that name without the suffix, as ``save_pretrained``
    shards them, and :attr:`Exported.note` says so. Any other ``out`` is such a directory."""
    not_tensors = [name for name, value in named if not reader.is_placeholder(value)]
    if not_tensors:
        raise ConfigError(
            f"the state dict holds values that are not tensors ({', '.join(not_tensors[:3])}), which safetensors "
            "cannot store: export it with --format torch"
        )
    shards = plan_shards(named, max_shard_bytes)
    metadata = {METADATA_KEY: json.dumps(origin)}
    if not out.lower().endswith(SUFFIXES["safetensors"]):
        _write_shards(shards, out, reader, metadata, done, overwrite, options)
        return
    fs, target = url_to_fs(out, **(options or {}))
    if fs.isdir(target):
        raise ConfigError(
            f"{out} is a directory (an earlier export's?): a .safetensors name is written as one file; remove the "
            "directory, or name it without the suffix to write save_pretrained's layout into it"
        )
    if fs.exists(target) and not overwrite:
        raise ConfigError(f"{out} exists: pass --overwrite (overwrite=True) or give another path")
    if len(shards) == 1:
        with atomic_output(out, storage_options=options) as stream:
            write_shard(shards[0], stream, reader, metadata)
        done.files.append(out)
        done.tensor_bytes = shards[0].nbytes
        return
    folder = out[: -len(".safetensors")]
    _write_shards(shards, folder, reader, metadata, done, overwrite, options)
    if fs.exists(target):  # an earlier export's file there would be loaded in place of the new shards
        fs.rm_file(target)
    done.note = (
        f"the weights ({_amount(done.tensor_bytes)}) exceed --max-shard-size ({_amount(max_shard_bytes)}), so "
        f"{out} was not written: {len(shards)} files and {INDEX_FILE} are in the directory {folder}, as "
        f"save_pretrained shards them; for one file pass --max-shard-size {_at_least(done.tensor_bytes)}"
    )


def _amount(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 10**9 else f"{n / 1e6:.1f} MB" if n >= 10**6 else f"{n} bytes"


def _at_least(n: int) -> str:
    """A ``--max-shard-size`` of ``n`` bytes or more, rounded up in the largest unit that ``n`` reaches."""
    unit, scale = next(((u, s) for u, s in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)) if n >= s), ("", 1))
    return f"{-(-n // scale)}{unit}"


def _write_shards(
    shards: list[safetensors_file.Shard],
    out: str,
    reader: StepReader,
    metadata: dict[str, str],
    done: Exported,
    overwrite: bool,
    options: dict[str, Any] | None,
) -> None:
    """``save_pretrained``'s directory layout: ``model.safetensors``, or shards and their index."""
    fs, folder = url_to_fs(out, **(options or {}))
    earlier = [p for p in fs.glob(f"{folder.rstrip('/')}/model*.safetensors*") if _is_export_file(p)]
    if earlier and not overwrite:
        raise ConfigError(f"{out} already holds an export ({os.path.basename(earlier[0])}): pass --overwrite")
    for shard in shards:
        with atomic_output(_join(out, shard.name), storage_options=options) as stream:
            write_shard(shard, stream, reader, metadata)
        done.files.append(_join(out, shard.name))
        done.tensor_bytes += shard.nbytes
    if len(shards) > 1:
        with atomic_output(_join(out, INDEX_FILE), storage_options=options) as stream:
            stream.write(json.dumps(index(shards), indent=2).encode())
        done.files.append(_join(out, INDEX_FILE))
    kept = {os.path.basename(path) for path in done.files}
    for path in earlier:  # a single file left beside a new index (or the reverse) would be loaded instead
        if os.path.basename(path) not in kept:
            fs.rm_file(path)


def _is_export_file(path: str) -> bool:
    name = os.path.basename(path)
    return name == INDEX_FILE or (name.startswith("model") and name.endswith(".safetensors"))


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


# ---- reading a whole step, and writing files atomically -------------------------------------------------------


def _committed_entry(tier: Tier, step: int | None) -> catalog.Entry:
    usable = [e for e in catalog.scan(tier) if e.manifest is not None and e.manifest.is_global]
    entry = next((e for e in usable if step is None or e.step == step), None)
    if entry is None:
        which = "any step" if step is None else f"step {step}"
        have = ", ".join(str(e.step) for e in usable) or "none"
        raise NoCheckpointError(
            f"No committed checkpoint of {which} with every rank's files under {tier.url} (committed: {have})"
        )
    return entry


def read_committed(
    tier: Tier, step: int, *, rank: int = 0, verify: bool = True, allow_pickle: bool = False
) -> Restored:
    """Step ``step`` of ``tier``, all of it, with rank ``rank``'s own state; tensors on CPU.

    ``verify`` checksums every file first (skip it only for a checkpoint this process has just written and
    hashed itself).
    """
    entry = committed_entry(tier, step, verify=verify)
    plan = plan_load(entry, None, rank=rank)
    return run_load(entry, plan, group=None, allow_pickle=allow_pickle)


def committed_entry(tier: Tier, step: int | None, *, verify: bool) -> catalog.Entry:
    """Step ``step`` (None: the newest) of ``tier``, committed with every rank's files; ``verify`` checksums
    every file first."""
    entry = _committed_entry(tier, step)
    if verify:
        catalog.verify(entry, full=True)
    return entry


def write_file_atomically(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    fsync: bool = True,
    storage_options: dict[str, Any] | None = None,
    ready: Callable[[], object] | None = None,
) -> None:
    """``torch.save`` ``obj`` to ``path`` so that ``path`` is either the old file or the whole new one (``ready``:
    see :func:`atomic_output`)."""
    with atomic_output(path, fsync=fsync, storage_options=storage_options, ready=ready) as stream:
        torch.save(obj, stream)


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[str]:
    """Delete the temporary files :func:`atomic_output` left beside local ``path`` in processes that are gone (a
    writer killed mid-file leaves its temporary file, never a partial ``path``), and the half-built folders of a
    folder name (``lightning_sharded.folder_in_place``); returns what it deleted.

    Only files of these patterns whose process id no process on this host has now are touched: a temporary file
    of a writer still running stays."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return []
    target = text.removeprefix("file://")
    directory, base = os.path.split(target)
    pattern = re.compile(re.escape(f".{base}.tmp-") + r"([0-9]+)-[0-9a-f]{8}")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory or "."):
            found = pattern.fullmatch(entry.name)
            if found is None or _alive(int(found.group(1))):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc here: a zombie counts as running, its file stays
        return True


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike[str],
    *,
    fsync: bool = True,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = True,
    ready: Callable[[], object] | None = None,
) -> Iterator[IO[bytes]]:
    """A new local file (readable, seekable) that becomes ``path`` once the block ends without an error.

    Local paths: a temporary file beside ``path``, flushed, then renamed over it. URLs (fsspec, with
    ``storage_options``): one upload of a local temporary file, which object stores make visible all at once.
    ``ready`` is waited for between the two: the file is written while what it must not come before finishes
    (a name's commit), and does not become ``path`` if ``ready`` raises.
    """
    text = os.fspath(path)
    fs, target = url_to_fs(text, **(storage_options or {}))
    if not overwrite and fs.exists(target):
        raise ConfigError(f"{text} exists: pass --overwrite (overwrite=True) or give another path")
    local = "://" not in text or text.startswith("file://")
    directory = os.path.dirname(target) if local else None
    tmp = os.path.join(
        directory or tempfile.gettempdir(), f".{os.path.basename(target)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    if directory:
        os.makedirs(directory, exist_ok=True)
    try:
        with open(tmp, "w+b") as stream:
            yield stream
            if fsync:
                stream.flush()
                os.fsync(stream.fileno())
        if ready is not None:
            ready()
        if local:
            os.replace(tmp, target)
        else:
            fs.put_file(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
