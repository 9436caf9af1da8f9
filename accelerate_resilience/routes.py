"""The Accelerator's own methods that ``attach()`` routes to the handle, and the folders Accelerate names.

``save_state()`` and ``load_state()`` on this plugin's folders (or with none) go to the handle, so existing
scripts keep their calls; ``skip_first_batches`` keeps the handle's view of the training loader, and
``end_training`` closes the handle while the process group still exists.

With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, Accelerate's users and tools expect each
``save_state()`` to leave ``<project_dir>/checkpoints/checkpoint_<i>``, ``i`` being ``save_iteration``, that stock
``load_state(path)`` reads, and ``total_limit`` of them. :class:`ProjectFolders` makes them: names written from
the committed step (:mod:`resilience.formats.accelerate_folder`), like the Lightning adapter's ``.ckpt`` files,
before ``save_state()`` returns for a small state, as Accelerate's own save is, in the background for a large one.
A ``load_state()`` of such a folder loads its step from the engine, verified, while the engine holds it.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from accelerate import Accelerator

from accelerate_resilience import compat
from resilience.checkpoint.manager import CheckpointManager
from resilience.checkpoint.save_handle import SaveHandle
from resilience.checkpoint.tree import tensor_bytes
from resilience.errors import ConfigError
from resilience.formats import accelerate_folder
from resilience.formats.names import repaired_writer
from resilience.goodput import TimedIterator

if TYPE_CHECKING:
    from accelerate_resilience.handle import ResilienceHandle, ResumePoint

ROUTED = ("save_state", "load_state", "skip_first_batches", "end_training")
SYNC_FOLDERS_BELOW_BYTES = 64 * 2**20  # a smaller state's folder is written before save_state() returns
_NUMBER = re.compile(r"checkpoint_(\d+)$")


class ProjectFolders:
    """The ``checkpoint_<i>`` folders of automatic checkpoint naming, written by rank 0 from committed steps.

    ``enabled`` only with automatic naming, a ``project_dir``, and models that are not DTensor shards (FSDP2
    keeps its checkpoints under ``local_root``).
    """

    def __init__(self, accelerator: Accelerator, manager: CheckpointManager, sharded: bool):
        project = accelerator.project_configuration
        self.accelerator = accelerator
        self.manager = manager
        self.enabled = bool(project.automatic_checkpoint_naming and project.project_dir) and not sharded
        self.folder = os.path.abspath(os.path.join(project.project_dir or ".", "checkpoints"))
        self.names = repaired_writer(manager) if self.enabled else None  # rank 0's

    def path(self, iteration: int) -> str:
        return os.path.join(self.folder, f"checkpoint_{iteration}")

    def check_free(self) -> None:
        """Before a save: the folder it would name must not exist (Accelerate's own save raises too); the same
        answer on every rank."""

        def free() -> None:
            path = self.path(self.accelerator.project_configuration.iteration)
            if os.path.exists(path):
                raise ConfigError(
                    f"save_state(): {path} already exists, and this save would be named so "
                    f"(save_iteration={self.accelerator.save_iteration}). Resume first (load_state()), which "
                    "continues the numbering, or set accelerator.project_configuration.iteration past it"
                )

        self.manager.groups.control.decide(free)

    def name(self, handle: SaveHandle, iteration: int, safetensors: bool, state_bytes: int) -> str:
        """Name ``handle``'s step ``checkpoint_<iteration>``; a small state's folder is there on return."""
        path = self.path(iteration)
        layout = accelerate_folder.SAFETENSORS if safetensors else accelerate_folder.PICKLED
        written: Future[None] | None = None
        if self.names is not None:
            written = self.names.add(path, handle.step, [], handle, self.manager.run_id, layout=layout)
        if state_bytes < SYNC_FOLDERS_BELOW_BYTES:
            (written or handle.committed).result()
            self.prune()
        elif written is not None:
            written.add_done_callback(lambda _: self.prune())
        return path

    def prune(self) -> None:
        """Keep ``total_limit`` folders, the newest by number, once a newer one is written (Accelerate deletes
        before it writes, which can leave none). Only folders this pack named are deleted."""
        limit = self.accelerator.project_configuration.total_limit
        if self.names is None or not limit:
            return
        ours = sorted(
            (int(found.group(1)), name.path)
            for name in self.names.recorded()
            if name.written and os.path.dirname(name.path) == self.folder and (found := _NUMBER.search(name.path))
        )
        for _, path in ours[:-limit]:
            self.names.forget(path)

    def step_of(self, path: str | os.PathLike[str]) -> int | None:
        """The engine step the named folder ``path`` holds, if the engine still has it (then a load takes it from
        the engine, verified); rank 0's answer on every rank. A folder still being written is waited for."""

        def lookup() -> int | None:
            if self.names is None:
                return None
            pending = self.names.pending(os.fspath(path))
            if pending is not None:
                pending.result()
            name = self.names.lookup(os.fspath(path))
            held = name is not None and name.step in self.manager.committed_steps()
            return name.step if held and name is not None else None

        return self.manager.groups.control.decide(lookup) if self.enabled else None

    def pending_steps(self) -> set[int]:
        return self.names.pending_steps() if self.names is not None else set()

    def wait(self) -> None:
        if self.names is not None:
            self.names.wait()


class Routes:
    """Accelerate's methods as ``attach()`` replaces them on one Accelerator (:data:`ROUTED`)."""

    def __init__(self, handle: ResilienceHandle, folders: ProjectFolders):
        self.handle = handle
        self.folders = folders
        self.originals = {name: getattr(handle.accelerator, name) for name in ROUTED}

    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str | None:
        handle = self.handle
        ours, _ = handle.manager.config.locate(output_dir, "save_state")
        if not ours:
            return self.originals["save_state"](output_dir, safe_serialization=safe_serialization, **kwargs)
        if self.folders.enabled:
            self.folders.check_free()
        iteration = handle.accelerator.project_configuration.iteration
        saved = handle.save()
        # Accelerate's own save_state() leaves the state free to change once it returns (an EMA swapped in for an
        # evaluation, parameters edited by hand): by then the copy no longer reads the live state. On CUDA later
        # work on the stream is ordered after the copy, without blocking; on CPU this waits for the copy.
        handle.manager.wait_for_staging()
        if saved is None:
            return None
        if not self.folders.enabled:
            return handle.manager.local.step_path(saved.step)
        state_bytes = sum(tensor_bytes(model.state_dict()) for model in compat.models(handle.accelerator))
        return self.folders.name(saved, iteration, safe_serialization, state_bytes)

    def load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> ResumePoint | None:
        handle = self.handle
        named = self.folders.step_of(input_dir) if input_dir is not None else None
        if named is not None:
            return handle.resume(named)
        ours, step = handle.manager.config.locate(input_dir, "load_state")
        if not ours:
            return self.originals["load_state"](input_dir, load_kwargs=load_kwargs, **kwargs)
        return handle.resume(step)  # also the examples' --resume_from_checkpoint <dir>/step-N

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, TimedIterator):  # skip in the loader it times, and time the result
            inner = self.skip_first_batches(dataloader.iterable, num_batches)
            return dataloader if inner is dataloader.iterable else self.handle.timed(inner)
        tracker = self.handle.tracker
        if tracker is None or dataloader is not tracker.loader:
            return self.originals["skip_first_batches"](dataloader, num_batches)
        if num_batches == 0:  # Accelerate would rebuild the loader, dropping a StatefulDataLoader's cursor
            return dataloader
        child = self.originals["skip_first_batches"](dataloader, num_batches)
        tracker.follow_skip(child, num_batches)
        return child

    def end_training(self) -> None:
        original = self.originals["end_training"]
        self.handle.close()  # before the process group goes: the last saves still need it (exits after a stop)
        original()
