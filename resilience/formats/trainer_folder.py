"""A committed step of a Hugging Face Trainer run as the ``checkpoint-<N>`` folder the Trainer's own save writes.

The Trainer's users and tools expect ``<output_dir>/checkpoint-<N>`` folders: ``get_last_checkpoint`` names the
newest, ``save_total_limit`` counts them, and a Trainer without this pack resumes from one
(``train(resume_from_checkpoint=path)``). The engine's ``step-<N>`` directory stays the source of truth; the folder
is made from it after its commit (a name, :mod:`resilience.formats.names`), a few tensors at a time, in a temporary
folder renamed into place, so it never exists half written.

What it holds, by the Trainer's file names (``Trainer._save_checkpoint``, checked against transformers 5.25): the
weights as ``save_pretrained`` writes them (``model.safetensors``, or its shards and index), ``optimizer.pt``,
``scheduler.pt``, ``scaler.pt`` with a GradScaler, ``rng_state.pth`` of one process or ``rng_state_<rank>.pth`` of
every rank whose own state this node holds, ``trainer_state.json``, and what the Trainer writes beside the weights
(``config.json``, ``generation_config.json``, the tokenizer's files, ``training_args.bin``). Which weights, under
which names, and those other files' bytes: the adapter works them out with transformers and saves them in rank 0's
own state (:data:`PLAN`), so this module imports neither transformers nor Accelerate. A step without them (saved
by an earlier version) gets every weight of the state dict and no other files: the folder still resumes.

The weights' header also says which run and step the folder was made from (:func:`origin`), so the pack knows its
own folders after the output directory was copied or moved, and never takes a folder it did not make for one.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from resilience.checkpoint.step_reader import StepReader
from resilience.errors import ConfigError
from resilience.formats.export import METADATA_KEY, atomic_output, committed_entry
from resilience.formats.lightning_sharded import folder_in_place
from resilience.formats.safetensors_file import INDEX_FILE, index, plan_shards, write_shard
from resilience.formats.torch_file import write_torch_file
from resilience.storage.layout import STATE_FILE, rank_state_file
from resilience.storage.tiers import LocalTier

LAYOUT = "transformers"  # a name's layout: the Trainer's checkpoint folder
ADAPTER = "transformers"  # the adapter that saves such steps (their manifest says so)
# In rank 0's own state: {"weights": [[name in the file, name in the state dict], ...], "max_shard_bytes": int or
# None (one file), "cuda": "all" (every device's RNG state, as under DDP), a device index (that device's) or None,
# "files": {file name: bytes}}
PLAN = "trainer_folder"
TRAINER_STATE = "trainer_state.json"


def write_trainer_folder(local: LocalTier, step: int, path: str, *, verify: bool, allow_pickle: bool) -> None:
    """Make ``path`` the folder ``Trainer._save_checkpoint`` would have written for committed step ``step``."""
    entry = committed_entry(local, step, verify=verify)
    assert entry.manifest is not None
    if entry.manifest.extra.get("adapter") != ADAPTER:
        raise ConfigError(f"{entry.where()} was not saved by the Trainer adapter: it makes no checkpoint-N folder")
    reader = StepReader(entry, allow_pickle=allow_pickle)
    shared = reader.tree(STATE_FILE)
    ranks = {}
    for rank in range(entry.manifest.world_size):
        name = rank_state_file(rank)
        if entry.manifest.file(name) is not None and local.exists(f"{entry.path}/{name}"):
            ranks[rank] = reader.tree(name)
    plan = (ranks.get(0) or {}).get(PLAN) or {}
    files: dict[str, bytes] = {TRAINER_STATE: shared["trainer_state"].encode(), **plan.get("files", {})}
    pickled = {"optimizer.pt": shared["optimizer"], "scheduler.pt": shared["scheduler"]}
    if shared["scaler"] is not None:
        pickled["scaler.pt"] = shared["scaler"]
    for rank, state in ranks.items():
        name = "rng_state.pth" if entry.manifest.world_size <= 1 else f"rng_state_{rank}.pth"
        pickled[name] = rng_file(state["rng_streams"], plan.get("cuda"))
    made_from = {"step": step, "run_id": entry.manifest.run_id, "local_root": local.root}
    with folder_in_place(path) as building:
        _write_weights(building, shared["model"], plan, reader, {METADATA_KEY: json.dumps(made_from)})
        for name, content in pickled.items():
            with atomic_output(os.path.join(building, name)) as stream:
                write_torch_file(content, stream, reader)
        for name, data in files.items():
            with atomic_output(os.path.join(building, name)) as stream:
                stream.write(data)


def rng_file(streams: dict[str, Any], cuda: str | int | None) -> dict[str, Any]:
    """What ``Trainer._save_rng_state`` saves, from the engine's RNG streams (:func:`~resilience.checkpoint.rng.
    capture_rng`): ``"cpu"`` is torch's stream; ``"cuda"`` every device's under DDP, else the one device's."""
    state = {"python": streams["python"], "numpy": streams["numpy"], "cpu": streams["torch"]}
    devices = streams.get("cuda")
    if devices is not None and cuda == "all":
        state["cuda"] = devices
    elif devices is not None and isinstance(cuda, int) and cuda < len(devices):
        state["cuda"] = devices[cuda]
    return state


def origin(folder: str) -> dict[str, Any] | None:
    """The run and step (``{"step", "run_id", "local_root"}``) a folder was made from, as its weights' header says;
    None for a folder the pack did not make (or that cannot be read)."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("model") and n.endswith(".safetensors"))
        if not names:
            return None
        with open(os.path.join(folder, names[0]), "rb") as stream:
            (size,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(min(size, 100 << 20)))
        made_from = json.loads(header["__metadata__"][METADATA_KEY])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return made_from if isinstance(made_from, dict) and isinstance(made_from.get("step"), int) else None


def _write_weights(
    building: str, model: dict[str, Any], plan: dict[str, Any], reader: StepReader, metadata: dict[str, str]
) -> None:
    """``model.safetensors`` (or ``save_pretrained``'s shards and index) with the plan's weights and names."""
    pairs = plan.get("weights") or [(name, name) for name in model]
    missing = [source for _, source in pairs if source not in model]
    if missing:
        raise ConfigError(f"{reader.entry.where()} lacks the weights {missing[:3]} its folder plan names")
    limit = plan.get("max_shard_bytes")
    shards = plan_shards([(name, model[source]) for name, source in pairs], limit if limit else 2**63)
    for shard in shards:
        with atomic_output(os.path.join(building, shard.name)) as stream:
            write_shard(shard, stream, reader, metadata)
    if len(shards) > 1:
        with atomic_output(os.path.join(building, INDEX_FILE)) as stream:
            stream.write((json.dumps(index(shards), indent=2, sort_keys=True) + "\n").encode())
