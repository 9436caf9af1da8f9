"""``attach()``: asynchronous, resumable checkpoints for an Accelerator the user already has.

A handle attached to the user's Accelerator rather than an Accelerator subclass: the subclass would have to be
the class every script, library (``transformers.Trainer``, ``diffusers`` examples) and launcher builds, while an
attached handle works with whichever Accelerator they made. The step boundary (interval saves, health, goodput)
is the engine's :class:`~resilience.session.TrainingSession`; the handle builds the state, wires Accelerate's
hooks to the session, and logs to the accelerator's trackers. ``accelerator.save_state()`` and ``load_state()``
on this plugin's folders are routed here, so existing scripts keep their calls. See ``docs/ACCELERATE.md``.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.hooks import RemovableHandle

from accelerate_resilience import compat, snapshot
from accelerate_resilience.plugin import ResiliencePlugin
from accelerate_resilience.routes import ROUTED, ProjectFolders, Routes
from resilience.checkpoint.manager import CheckpointManager
from resilience.checkpoint.numbering import CheckpointNumbers
from resilience.checkpoint.position import DataTracker, Position
from resilience.checkpoint.rng import capture_rng
from resilience.checkpoint.save_handle import SaveHandle
from resilience.checkpoint.staging import barrier_for
from resilience.config import auto_persist
from resilience.errors import CheckpointError, CheckpointExistsError, ConfigError
from resilience.goodput import IntervalPlan, TimedIterator
from resilience.health import HealthConfig
from resilience.logs import print_to_stderr, rank_zero
from resilience.persist.fork_server import stop_early_server
from resilience.recovery import inplace
from resilience.recovery.peer_loss import BoundarySnapshot
from resilience.session import SaveState, TrainingSession

T = TypeVar("T")

_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


@dataclass(frozen=True)
class ResumePoint:
    """Where to continue after :meth:`ResilienceHandle.resume`.

    Attributes:
        epoch: The epoch to continue in (the training loader's epoch counter is already set to it).
        batch_in_epoch: Batches of that epoch already trained on.
        global_step: Optimizer steps done.
        restored: Whether a checkpoint was loaded (False: nothing to resume, start from scratch).
        batches_to_skip: What to pass to ``accelerator.skip_first_batches`` for the resumed epoch: 0 when the
            loader continues mid-epoch by itself (StatefulDataLoader), ``batch_in_epoch`` for a plain DataLoader.
        path: The checkpoint that was loaded.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    global_step: int = 0
    restored: bool = False
    batches_to_skip: int = 0
    path: str | None = None


class ResilienceHandle:
    """Saves and resumes everything an Accelerator prepared, through the asynchronous checkpoint engine.

    Made by :func:`attach`; construction is collective (every rank). Attributes: ``manager`` (the engine),
    ``session`` (the step boundary: ``session.ledger`` is the run's goodput ledger), ``global_step``
    (optimizer steps counted by a hook on the first prepared optimizer; steps a GradScaler skips are not
    counted), ``run_dir`` (where the ledger lives). Checkpoints are numbered by :class:`CheckpointNumbers`.

    Every optimizer step ends at the next batch the training loader hands out: that is the step boundary, where
    interval saves happen, the ranks agree on faults and preemption signals (with health on), and an agreed
    stop saves the step and makes :meth:`should_stop` True.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        plugin: ResiliencePlugin,
        dataloader: Any = None,
        health: HealthConfig | None = None,
    ):
        if accelerator.distributed_type in _UNSUPPORTED or (
            accelerator.distributed_type == DistributedType.FSDP and not compat.is_fsdp2(accelerator)
        ):
            raise ConfigError(
                f"accelerate_resilience does not handle {accelerator.distributed_type}, whose engine keeps its "
                "state in a checkpoint format of its own: use DDP, FSDP2 or one process, or save_state(output_dir)"
            )
        if compat.replaced(accelerator, "save_state") is not None:
            raise ConfigError("this Accelerator already has a ResilienceHandle: attach once, and close() it first")
        self.accelerator = accelerator
        self.plugin = plugin
        print_to_stderr(rank_zero)  # Accelerate's own lines show nothing unless set up
        project = accelerator.project_configuration
        limit = project.total_limit
        config = plugin.checkpoint_config(
            local_root=os.path.join(project.project_dir, "resilience") if project.project_dir else None,
            keep_last=max(2, limit) if limit else None,
            auto=auto_persist(compat.models(accelerator), accelerator.num_processes),
        )
        if config.persist == "thread":
            stop_early_server()
        # retention keeps the steps whose Accelerate folder is still to be written
        self.manager = CheckpointManager(
            barrier_for(config, compat.models(accelerator)), protected_steps=lambda: self._folders.pending_steps()
        )
        self._folders = ProjectFolders(accelerator, self.manager, snapshot.sharded(accelerator))
        self._sharded: bool | None = None  # whether the models are DTensor shards, once known
        self.session = TrainingSession(
            self.manager, self._state, is_main=accelerator.is_main_process, boundary=self._boundary_snapshot
        )
        self.session.add_sink(self._log)
        self.run_dir = os.fspath(plugin.run_dir or project.project_dir or config.local_root)
        plugin.configure(self.session, run_dir=self.run_dir, cuda=accelerator.device.type == "cuda", health=health)
        self._numbers = CheckpointNumbers()
        self._boundary_step = 0  # the optimizer steps at the last step boundary
        self._hooks: list[RemovableHandle] = []
        self._hooked: set[int] = set()
        self._training_loader = dataloader
        self._tracker: DataTracker | None = None
        self._warned_untracked = False
        routes = Routes(self, self._folders)
        for name in ROUTED:
            compat.replace(accelerator, name, getattr(routes, name))
        self._closed = False
        # a loop not inside `with attach(...)` that dies on a lost peer's collective still gets its survivor save
        self._excepthook_before = sys.excepthook
        sys.excepthook = self._uncaught
        if not compat.models(accelerator) and accelerator.is_main_process:
            warnings.warn(
                "attach() found no prepared model: call it after accelerator.prepare(...), so that step counting, "
                "interval saves and the data position are hooked before the first batch",
                stacklevel=3,
            )
        if compat.has_save_state_hooks(accelerator) and accelerator.is_main_process:
            warnings.warn(
                "Hooks registered with register_save_state_pre_hook are not called by accelerate_resilience's "
                "saves (they write into a folder; these saves are asynchronous); the models they see are in the "
                "checkpoint anyway. accelerator.save_state(<another folder>) still runs them, synchronously",
                stacklevel=3,
            )
        self._refresh()

    @property
    def ledger(self) -> Any:
        return self.session.ledger

    @property
    def tracker(self) -> DataTracker | None:
        """The training loader's position tracker, once the loader is known."""
        return self._tracker

    @property
    def global_step(self) -> int:
        """Optimizer steps done (restored by :meth:`resume`)."""
        return self._numbers.optimizer_steps

    # ---- save -------------------------------------------------------------------------------------------------

    def save(self, step: int | None = None) -> SaveHandle | None:
        """Checkpoint everything as it is now, in the background; collective (every rank, same step).

        Call it after a step's optimizer and scheduler steps: the checkpoint counts the batch just drawn as
        trained. Every call makes a new checkpoint, numbered above the last (:class:`CheckpointNumbers`: the
        optimizer steps, unless saves between two steps moved the numbers on), so a newer call is never answered
        by an older save; only a save this very call made at the step boundary (an interval save) is returned
        as it is. ``step`` numbers the checkpoint yourself: one saved already raises CheckpointExistsError.
        Returns None when the previous save is still running and ``when_busy="skip"``.
        """
        self._check_open()
        self._refresh()
        self.session.start(self._numbers.current)
        at_boundary = self._boundary()  # called after a step's optimizer step: that step is complete
        if at_boundary is not None and step is None:
            self.accelerator.project_configuration.iteration += 1
            return at_boundary  # made just now, by this call: the state at the call
        number = self._numbers.for_save() if step is None else self._own_number(int(step))
        handle = self.session.save(number)
        if handle is not None:
            self._numbers.saved(number)
            self.accelerator.project_configuration.iteration += 1  # what Accelerate's own save_state counts
        if self.ledger is not None:
            self.ledger.flush()
        return handle

    def _own_number(self, step: int) -> int:
        """The caller's number, if no checkpoint has it: an earlier one must not stand in for this call."""
        if step in self.manager.committed_steps():
            raise CheckpointExistsError(
                f"save(step={step}): step {step} is already saved or being saved, and a committed checkpoint is "
                "never overwritten. Leave step out: each save then takes the next free number"
            )
        return step

    def _state(self, step: int) -> SaveState:
        """Everything to save at ``step``: the shared training state, and each rank's own. Registered objects that
        only pickle could store are refused here, on every rank alike, rather than at the load."""
        built = self._boundary_snapshot(step)
        if compat.registered_objects(self.accelerator) and not self.manager.config.allow_pickle:
            objects = built.rank_state["objects"]
            self.manager.groups.control.agree(lambda: snapshot.refuse_pickles(self.accelerator, objects))
        return built.shared()

    def _boundary_snapshot(self, step: int) -> BoundarySnapshot:
        """The state at ``step``'s boundary: this rank's own (RNG, data position) by value now; the shared
        training state only when it is saved. A survivor save builds it later, after the boundary, from the same
        values: the peer-loss gate holds the next optimizer step (and with it the scheduler's and the scaler's)
        until then. Building it at every boundary cost a small model's loop half a millisecond a step. Sharded
        (DTensor) states are the exception: building one may take collectives, so it is built now, on the
        training thread."""
        position = self._position()
        progress = {
            "global_step": self.global_step,
            "epoch": position.epoch,
            "batch_in_epoch": position.batch_in_epoch,
            "accelerator_step": self.accelerator.step,
            "iteration": self.accelerator.project_configuration.iteration,
        }
        rank_state = {
            "rng": capture_rng(),
            "rng_at_next_batch": position.rng_at_next_batch,
            "objects": snapshot.object_states(self.accelerator),
            "loaders": snapshot.loader_states(self.accelerator),
        }

        def shared() -> SaveState:
            state = {"training": training or snapshot.training_state(self.accelerator), "progress": progress}
            return SaveState(state, rank_state, {"adapter": "accelerate", **progress})

        if self._sharded is None:  # the prepared models are the same all run long
            self._sharded = snapshot.sharded(self.accelerator)
        training = snapshot.training_state(self.accelerator) if self._sharded else None
        return BoundarySnapshot(step, rank_state, shared)

    def wait(self, *, durable: bool = False) -> None:
        """Block until the last save is committed locally (and uploaded, with ``durable``); raise its error."""
        self.session.wait(durable=durable)

    # ---- data -------------------------------------------------------------------------------------------------

    def timed(self, loader: Iterable[T]) -> TimedIterator[T]:
        """``loader``, timing how long each ``next()`` blocks: the accelerator's wait for data.

        Use it in the training loop (``for batch in resilience.timed(train_dl)``); it keeps the loader's
        length and attributes, and the handle still tracks the position of the loader inside. Per window of
        ``plugin.data_window_steps`` steps, logs ``data/wait_fraction``, ``data/samples_per_s``,
        ``data/step_ms``, ... and the ``goodput/*`` figures; above ``plugin.starvation_threshold`` it warns
        with the likely cause (workers, I/O, collate). Only the time spent waiting counts: loading that overlaps
        the step (workers, prefetching) does not, nor does the handle's own work at the batch boundary (saves,
        health checks), which runs inside ``next()``.
        """
        return self.session.timed(loader, compat.dataloader_of(loader))

    # ---- resume -----------------------------------------------------------------------------------------------

    def resume(self, step: int | None = None) -> ResumePoint:
        """Load the newest checkpoint that verifies (or ``step``) into everything prepared; collective.

        Restores models, optimizers, schedulers, GradScaler, registered objects (per rank), RNG (per rank),
        data loaders (epoch counter; StatefulDataLoader cursor) and the step counters. Returns a zero
        :class:`ResumePoint` with ``restored=False`` when there is no checkpoint yet.
        """
        self._check_open()
        self._refresh()
        restored = self.session.restore(
            lambda: {"training": snapshot.load_target(self.accelerator)},
            step=step,
            per_rank="each rank's RNG, data loader cursor and registered objects (the resumed epoch skips its "
            "trained batches with the new sharding)",
        )
        if restored is None:
            self.session.restored(None)
            return ResumePoint()
        where = f"checkpoint step {restored.step} ({restored.path})"
        snapshot.load_training_state(self.accelerator, restored.state["training"], where)
        progress = restored.state["progress"]
        self._numbers.restored(restored.step, int(progress["global_step"]))
        self._boundary_step = self.global_step
        if self.session.started:  # loaded mid-run: newer checkpoints are set aside at the next save, as on a restart
            self.manager.claim(resumed_from=restored.step)
        self.accelerator.step = progress["accelerator_step"]
        # as many saves as the run had made with this one; never fewer than this process made (Accelerate's own
        # load_state leaves the count alone), so the next folder's number is new
        project = self.accelerator.project_configuration
        project.iteration = max(project.iteration, int(progress.get("iteration", -1)) + 1)
        rank_state = restored.rank_state
        if rank_state is not None:
            snapshot.load_object_states(self.accelerator, rank_state["objects"], where)
            snapshot.load_loader_states(self.accelerator, rank_state["loaders"], where)
        epoch, batch = progress["epoch"], progress["batch_in_epoch"]
        positioned = rank_state is not None and self._tracker is not None and self._tracker.stateful
        if self._tracker is not None:
            self._tracker.resume_at(epoch, batch, positioned=positioned)
        at_next_batch = rank_state is not None and rank_state["rng_at_next_batch"] and self._tracker is not None
        self.session.restored(
            restored,
            rng_at="next_batch" if at_next_batch else "now",
            position=f"epoch {epoch}, batch {batch}, global step {self.global_step}",
        )
        return ResumePoint(
            epoch=epoch,
            batch_in_epoch=batch,
            global_step=self.global_step,
            restored=True,
            batches_to_skip=0 if positioned else batch,
            path=restored.path,
        )

    # ---- close ------------------------------------------------------------------------------------------------

    def should_stop(self) -> bool:
        """True on every rank once they agreed to stop (a fatal fault or a preemption signal on any rank).

        The step is already saved by then. Leave the training loop and call :meth:`close` (or
        ``accelerator.end_training()``), which exits with the stop's exit code for the launcher to restart or
        requeue the job; a loop that does not check is stopped the same way at its next batch.
        """
        return self.session.stopping is not None

    def close(self) -> None:
        """Finish every queued write and upload, log the last events, and give the Accelerator its methods back.

        Ends this incarnation in the goodput ledger as completed. After an agreed stop (:meth:`should_stop`),
        ends it as stopped instead, and exits with the stop's code (``SystemExit``).
        """
        self._close(None)

    def _close(self, failure: BaseException | None) -> None:
        if failure is not None:
            self.session.on_failure(failure)  # a lost peer: the survivors save and exit; else it goes on as it is
        if not self._closed:
            self._closed = True
            sys.excepthook = self._excepthook_before
            if self.session.started and not inplace.requested():  # after a lost peer: no collective
                self._boundary()  # the last step: no batch after it ended it
            self._release()
            if self.session.stopping is not None:
                for tracker in self.accelerator.trackers:  # what end_training would do; the group goes with the process
                    tracker.finish()
                self.session.exit()
            if failure is None:
                self._folders.wait()  # the folders of the last saves, and their errors
            self.session.end(failure)

    def _release(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._tracker is not None:
            self._tracker.detach()
        compat.put_back(self.accelerator, *ROUTED)

    def _uncaught(self, kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if not self._closed:
            self._close(error)
        self._excepthook_before(kind, error, trace)

    def __enter__(self) -> ResilienceHandle:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        self._close(exc)

    # ---- what the accelerator prepared, and the step boundary -------------------------------------------------

    def _refresh(self) -> None:
        """Hook whatever was prepared since the last call: step counting and the training loader."""
        accelerator = self.accelerator
        optimizers = compat.optimizers(accelerator)
        if optimizers and id(optimizers[0].optimizer) not in self._hooked:
            optimizer = optimizers[0].optimizer
            self._hooked.add(id(optimizer))
            self._hooks.append(optimizer.register_step_post_hook(self._count_step))
        if self._tracker is None:
            loader = self._training_loader
            if loader is None:
                loader = next(iter(compat.dataloaders(accelerator)), None)
            if loader is not None and compat.reports_batches(loader):
                self._tracker = DataTracker(loader, self._on_batch, compat)
                if compat.shuffles_unseeded(loader) and accelerator.is_main_process:
                    warnings.warn(
                        "The training data loader shuffles without a seedable sampler, so a resume mid-epoch "
                        "cannot replay its order: use DataLoaderConfiguration(use_seedable_sampler=True)",
                        stacklevel=3,
                    )
            elif loader is not None and not self._warned_untracked:
                self._warned_untracked = True
                warnings.warn(
                    f"The training data loader ({type(loader).__name__}) does not report batches one by one "
                    "(dispatch_batches?): resume() returns epoch 0, batch 0; track the epoch yourself",
                    stacklevel=3,
                )

    def _count_step(self, *_: Any) -> None:
        self._numbers.optimizer_steps += 1

    def _position(self) -> Position:
        return self._tracker.position() if self._tracker is not None else Position(0, 0, rng_at_next_batch=False)

    def _on_batch(self) -> None:
        """Just before the training loader hands out a batch: the previous step is complete."""
        if self.session.stopping is not None:  # the loop went on after should_stop(): stop it here
            self.close()
        self.session.start(self._numbers.current)
        self._boundary()
        self.session.step_begin(self._numbers.current, infer_wait=False)

    def _boundary(self) -> SaveHandle | None:
        """The boundary of a new optimizer step (the session counts in checkpoint numbers); the save it made."""
        if self.global_step == self._boundary_step:
            return None  # not every micro-batch is an optimizer step
        self._boundary_step = self.global_step
        number = self._numbers.current
        boundary = self.session.step_end(number)
        if boundary.saved is None or boundary.saved.step != number:
            return None
        self._numbers.saved(number)
        return boundary.saved

    @property
    def interval_plan(self) -> IntervalPlan | None:
        """With ``every_n_steps="auto"``: the current plan (the same on every rank); None before the first save."""
        return self.session.last_plan

    def _log(self, metrics: dict[str, float]) -> None:
        """The main process's trackers, at the current training step (W&B drops values logged at a past step)."""
        if self.accelerator.trackers and self.accelerator.is_main_process:
            self.accelerator.log(metrics, step=self.global_step)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this ResilienceHandle is closed; attach a new one")


def attach(
    accelerator: Accelerator,
    plugin: ResiliencePlugin | None = None,
    *,
    dataloader: Any = None,
    health: HealthConfig | None = None,
) -> ResilienceHandle:
    """Give ``accelerator`` asynchronous, resumable checkpoints; call on every rank after ``prepare()``.

    Args:
        accelerator: The job's Accelerator.
        plugin: Settings; default ``ResiliencePlugin()``, i.e. all from ``ACCELERATE_RESILIENCE_*``.
        dataloader: The training loader whose position resume() reports (default: the first one prepared).
        health: Health-monitoring settings; giving them turns monitoring on (as ``plugin.health`` does with
            the defaults: NVML on CUDA, SIGTERM/SIGINT/SIGUSR1 as preemption, the hang watchdog).
    """
    return ResilienceHandle(accelerator, plugin if plugin is not None else ResiliencePlugin(), dataloader, health)
