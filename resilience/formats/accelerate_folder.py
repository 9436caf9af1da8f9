"""A committed step of an Accelerate job as the folder Accelerate's own ``save_state`` writes.

With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, Accelerate's users and tools expect
``<project_dir>/checkpoints/checkpoint_<i>`` folders that stock ``accelerator.load_state(path)`` reads, with or
without this pack. The engine's ``step-<N>`` directory stays the source of truth; the folder is made from it
after its commit (a name, :mod:`resilience.formats.names`), streamed a few tensors at a time, in a temporary
folder renamed into place, so it never exists half written.

What it holds, by Accelerate's file names (``accelerate.utils.constants``, checked against 1.15): each model's
weights (``model.safetensors``, or ``pytorch_model.bin``; ``_<i>`` before the suffix for the i-th after the
first), ``optimizer.bin``, ``scheduler.bin``, ``scaler.pt``, each stateful loader's ``dl_state_dict.bin``, each
registered object's ``custom_checkpoint_<i>.pkl`` (rank 0's, as Accelerate keeps it), and
``random_states_<rank>.pkl`` of every rank whose own state this node holds (Accelerate loads a missing one as
"Could not load random states", and goes on).
"""

from __future__ import annotations

import os
from typing import Any

from resilience.checkpoint.step_reader import StepReader
from resilience.formats.export import atomic_output, committed_entry
from resilience.formats.lightning_sharded import folder_in_place
from resilience.formats.safetensors_file import Shard, write_shard
from resilience.formats.torch_file import write_torch_file
from resilience.storage.layout import STATE_FILE, rank_state_file
from resilience.storage.tiers import LocalTier

SAFETENSORS = "accelerate"  # a name's layout: Accelerate's folder, weights in safetensors (save_state's default)
PICKLED = "accelerate-bin"  # the same with ``pytorch_model.bin`` weights (``safe_serialization=False``)


def write_accelerate_folder(
    local: LocalTier, step: int, path: str, *, safetensors: bool, verify: bool, allow_pickle: bool
) -> None:
    """Make ``path`` the folder Accelerate's ``save_state`` would have written for committed step ``step``."""
    entry = committed_entry(local, step, verify=verify)
    reader = StepReader(entry, allow_pickle=allow_pickle)
    state = reader.tree(STATE_FILE)
    with folder_in_place(path) as building:
        files = _shared_files(state["training"], safetensors)
        assert entry.manifest is not None
        for rank in range(entry.manifest.world_size):
            name = rank_state_file(rank)
            if entry.manifest.file(name) is not None and local.exists(f"{entry.path}/{name}"):
                files.update(_rank_files(reader.tree(name), rank, state["progress"]))
        for file_name, content in files.items():
            with atomic_output(os.path.join(building, file_name)) as stream:
                if file_name.endswith(".safetensors"):
                    write_shard(Shard(file_name, list(content.items())), stream, reader, {})
                else:
                    write_torch_file(content, stream, reader)


def _numbered(name: str, index: int) -> str:
    """Accelerate's name of the ``index``-th file of a kind: ``optimizer.bin``, ``optimizer_1.bin``, ..."""
    stem, suffix = os.path.splitext(name)
    return name if index == 0 else f"{stem}_{index}{suffix}"


def _shared_files(training: dict[str, Any], safetensors: bool) -> dict[str, Any]:
    weights = "model.safetensors" if safetensors else "pytorch_model.bin"
    files: dict[str, Any] = {_numbered(weights, i): dict(model) for i, model in enumerate(training["models"])}
    files.update({_numbered("optimizer.bin", i): s for i, s in enumerate(training["optimizers"])})
    files.update({_numbered("scheduler.bin", i): s for i, s in enumerate(training["schedulers"])})
    if training["scaler"] is not None:
        files["scaler.pt"] = training["scaler"]
    return files


def _rank_files(rank_state: Any, rank: int, progress: dict[str, Any]) -> dict[str, Any]:
    """``random_states_<rank>.pkl``; for rank 0 also the loaders' and registered objects' state."""
    rng = rank_state["rng"]
    states = {
        "step": progress["accelerator_step"],
        "random_state": rng["python"],
        "numpy_random_seed": rng["numpy"],
        "torch_manual_seed": rng["torch"],
    }
    if rng.get("cuda") is not None:
        states["torch_cuda_manual_seed"] = rng["cuda"]
    files: dict[str, Any] = {f"random_states_{rank}.pkl": states}
    if rank == 0:
        for i, loader in enumerate(rank_state["loaders"]):
            if loader["state"] is not None:
                files[_numbered("dl_state_dict.bin", i)] = loader["state"]
        files.update({f"custom_checkpoint_{i}.pkl": obj for i, obj in enumerate(rank_state["objects"])})
    return files
