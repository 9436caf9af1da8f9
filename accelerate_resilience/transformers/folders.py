"""The Trainer's ``output_dir/checkpoint-N`` folders, made from the pack's committed steps.

The Trainer's users and tools expect a folder for each save: ``get_last_checkpoint`` names the newest, scripts read
``trainer_state.json`` or the weights from it, and a Trainer without this pack resumes from it. Rank 0's name writer
(:mod:`resilience.formats.names`) makes each from its committed, verified step
(:mod:`resilience.formats.trainer_folder`), in a temporary folder renamed into place: a folder never exists half
written, nor before its step is committed.
For a small state it is there when the save returns, as the Trainer's own is (``on_save`` callbacks find it); a
large state's appears a little later, while training goes on. ``save_total_limit`` applies to the folders as the
Trainer applies it (the newest and the best kept). Only folders this pack wrote are replaced or deleted: a folder
the Trainer or a user made stops a run that would write over it, before it trains.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

from transformers import Trainer

from accelerate_resilience.routes import SYNC_FOLDERS_BELOW_BYTES
from accelerate_resilience.transformers import compat
from resilience.checkpoint.manager import CheckpointManager
from resilience.checkpoint.save_handle import SaveHandle
from resilience.checkpoint.tree import tensor_bytes
from resilience.errors import ConfigError
from resilience.formats import trainer_folder
from resilience.formats.names import Name, repaired_writer
from resilience.storage import catalog

log = logging.getLogger(__name__)


class TrainerFolders:
    """The ``checkpoint-<N>`` folders of one ``train()`` call; rank 0 writes them, every rank asks about them.

    ``plan``: what a folder holds beside the step's state, worked out at :meth:`prepare` (rank 0 keeps it in its
    own state at every save); ``enabled`` is False for a model whose weights the Trainer saves in a form of its own.
    """

    def __init__(self, trainer: Trainer, manager: CheckpointManager):
        self.trainer = trainer
        self.manager = manager
        self.output_dir = compat.output_dir(trainer)
        self.names = repaired_writer(manager)  # rank 0's; the folders a killed process left unwritten go first
        self.plan: dict[str, Any] | None = None
        self.enabled = True
        self._lock = threading.Lock()

    def path(self, step: int) -> str:
        """Where the Trainer's own save would put step ``step``: ``output_dir/checkpoint-<step>``."""
        return os.path.join(self.output_dir, f"{compat.PREFIX_CHECKPOINT_DIR}-{step}")

    def prepare(self) -> None:
        """Training begins (the model is final): which weights a folder holds, under which names, on every rank
        alike; on rank 0 also the files the Trainer writes beside them, as they are now."""
        trainer, model = self.trainer, compat.model(self.trainer)
        try:
            weights = compat.saved_weights(model)
        except ConfigError as exc:
            self.enabled = False
            if trainer.args.process_index == 0:
                log.warning(
                    "No checkpoint-N folders for this run: %s. The checkpoints are in %s; resume with "
                    "train(resume_from_checkpoint=True), or write the model with trainer.save_model()",
                    exc,
                    self.manager.local.root,
                )
            return
        if self.names is None:
            return
        plan: dict[str, Any] = {"weights": weights, "max_shard_bytes": compat.max_shard_bytes(model)}
        plan["cuda"] = compat.rng_devices(trainer)
        plan["files"] = compat.side_files(trainer)
        self.plan = plan

    def rank_state(self) -> dict[str, Any]:
        """What this rank adds to its own state at a save: rank 0, the folder's plan."""
        return {trainer_folder.PLAN: self.plan} if self.plan is not None else {}

    def check_free(self, start: int) -> None:
        """Before training from step ``start``: no folder this run could write (a higher number) may be one the
        pack did not write; the same answer on every rank."""

        def free() -> None:
            if self.names is None or not os.path.isdir(self.output_dir):
                return
            for entry in sorted(os.listdir(self.output_dir)):
                step = compat.stock_step(entry)
                path = os.path.join(self.output_dir, entry)
                if step is not None and step > start and os.path.isdir(path) and not self._ours(path):
                    raise ConfigError(
                        f"{path} was not written by the pack, and this run, from step {start}, may save step {step}: "
                        "the pack never writes over a folder it did not make. Resume from it "
                        f"(train(resume_from_checkpoint={path!r})), move it out of {self.output_dir}, or give the "
                        "Trainer another output_dir"
                    )

        if self.enabled:
            self.manager.groups.control.decide(free)

    def name(self, handle: SaveHandle) -> None:
        """Name ``handle``'s step ``checkpoint-<step>``; a small state's folder is there on return, on rank 0."""
        if not self.enabled:
            return
        path = self.path(handle.step)
        written: Future[None] | None = None
        if self.names is not None:
            if os.path.exists(path) and not self._ours(path):
                log.error("Not writing %s: a folder the pack did not make is there (step %d is saved in %s)",
                          path, handle.step, self.manager.local.root)  # fmt: skip
            else:
                layout = trainer_folder.LAYOUT
                written = self.names.add(path, handle.step, [], handle, self.manager.run_id, layout=layout)
        if tensor_bytes(compat.model(self.trainer).state_dict()) < SYNC_FOLDERS_BELOW_BYTES:
            (written or handle.committed).result()
            self.prune()
        elif written is not None:
            written.add_done_callback(lambda _: self.prune())

    def prune(self) -> None:
        """``save_total_limit`` as the Trainer's rotation applies it, to the folders this pack wrote: the newest and
        the best stay, the oldest go first (folders of steps the engine no longer holds before those it does:
        an earlier run's, set aside)."""
        limit = self.trainer.args.save_total_limit
        if self.names is None or not limit or limit <= 0:
            return
        with self._lock:
            held = self.manager.committed_steps()
            ours = sorted((name.step in held, name.step, name.path) for name in self._recorded() if name.written)
            if not ours:
                return
            best = self.trainer.state.best_model_checkpoint
            protected = {ours[-1][2]} | ({os.path.abspath(best)} if best else set())
            remaining, keep = len(ours), max(limit, len(protected))
            for _, _, path in ours:
                if remaining <= keep:
                    break
                if path not in protected:
                    self.names.forget(path)
                    remaining -= 1

    def step_of(self, path: str) -> int | None:
        """The engine step a folder of this pack's holds, while the engine holds it (a load takes it from there,
        verified), after its write if it is still being written; rank 0's answer on every rank."""

        def lookup() -> int | None:
            if self.names is None:
                return None
            pending = self.names.pending(path)
            if pending is not None:
                pending.result()
            name = self.names.lookup(path)
            if name is not None and name.step in self.manager.committed_steps():
                return name.step
            return self._made_here(path)[1]

        return self.manager.groups.control.decide(lookup) if self.enabled else None

    def pending_steps(self) -> set[int]:
        return self.names.pending_steps() if self.names is not None else set()

    def settle(self) -> None:
        """The end of training: every folder asked for is written (or its error raised), and rotated."""
        if self.names is not None:
            self.names.wait()
            self.prune()

    def _recorded(self) -> list[Name]:
        """The names this pack recorded as folders of this output directory."""
        here = os.path.abspath(self.output_dir)
        assert self.names is not None
        return [
            name
            for name in self.names.recorded()
            if name.layout == trainer_folder.LAYOUT and os.path.dirname(name.path) == here
        ]

    def _ours(self, path: str) -> bool:
        """Whether the pack made the folder: this root's record says so, or its weights name this root's run."""
        assert self.names is not None
        return self.names.lookup(path) is not None or self._made_here(path)[0]

    def _made_here(self, path: str) -> tuple[bool, int | None]:
        """By the origin a folder's weights carry (for an output directory copied or moved, which the record names
        elsewhere): whether it was made from a run whose steps this root holds, and the step, while held."""
        made_from = trainer_folder.origin(path)
        run, held = False, None
        if made_from is None:
            return run, held
        for entry in catalog.scan(self.manager.local):
            if entry.manifest is not None and entry.manifest.run_id == made_from["run_id"]:
                run = True
                held = entry.step if entry.step == made_from["step"] else held
        return run, held
