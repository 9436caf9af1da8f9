"""``attach()``: asynchronous, resumable checkpoints for an Accelerator the user already has.

A handle attached to the user's Accelerator rather than an Accelerator subclass: the subclass would have to be
the class every script, library (``transformers.Trainer``, ``diffusers`` examples) and launcher builds, while an
attached handle works with whichever Accelerator they made. The handle reads what the accelerator prepared at
each save (so it always sees the live objects), and routes ``accelerator.save_state()`` /
``accelerator.load_state()`` without a path to the engine, so existing scripts keep their calls. See
``docs/ACCELERATE.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.hooks import RemovableHandle

from accelerate_resilience.goodput import AutoInterval, LoaderMonitor
from accelerate_resilience.plugin import AUTO, ResiliencePlugin
from accelerate_resilience.position import DataTracker, Position, load_loader_states, loader_states, trackable
from accelerate_resilience.snapshot import (
    load_object_states,
    load_training_state,
    object_states,
    training_state,
)
from accelerate_resilience.telemetry import TrackerBridge
from resilience.errors import CheckpointError, ConfigError
from resilience.goodput import DataWindow, GoodputLedger, IntervalPlan, TimedIterator
from resilience.goodput.ledger import COMPLETED
from resilience.health import Decision, HealthConfig, HealthGuard
from resilience.manager import CheckpointManager
from resilience.pipeline import SaveHandle
from resilience.rng import capture_rng, restore_rng

log = logging.getLogger(__name__)
T = TypeVar("T")

_ROUTED = ("save_state", "load_state", "skip_first_batches", "end_training")
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)
_process_accounted = False  # whether a ledger of this process already counted the process's start-up


@dataclass(frozen=True)
class ResumePoint:
    """Where to continue after :meth:`ResilienceHandle.resume`.

    Attributes:
        epoch: The epoch to continue in (the training loader's epoch counter is already set to it).
        batch_in_epoch: Batches of that epoch already trained on.
        global_step: Optimizer steps done; also the number the next checkpoints continue from.
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

    Made by :func:`attach`; construction is collective (every rank). Attributes: ``manager`` (the engine's
    :class:`~resilience.CheckpointManager`), ``global_step`` (optimizer steps counted by a hook on the first
    prepared optimizer; steps a GradScaler skips are not counted), ``ledger`` (the run's
    :class:`~resilience.goodput.GoodputLedger`; written by the main process when ``plugin.goodput``),
    ``run_dir`` (where it lives), ``data_monitor`` (the :meth:`timed` loaders' monitor, once there is one).

    Every optimizer step ends at the next batch the training loader hands out: the ledger counts the step
    there, and the time saves blocked (including the wait for an asynchronous copy before the next optimizer
    step) as checkpoint stall.

    With health monitoring on, every batch the training loader hands out is a step boundary where the ranks
    agree (one all-reduce) on the faults and preemption signals any of them saw; on a stop, every rank saves
    the same step at once and :meth:`should_stop` turns True.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        plugin: ResiliencePlugin,
        dataloader: Any = None,
        health: HealthConfig | None = None,
    ):
        if accelerator.distributed_type in _UNSUPPORTED or (
            accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2
        ):
            raise ConfigError(
                f"accelerate_resilience does not handle {accelerator.distributed_type}, whose engine keeps its "
                "state in a checkpoint format of its own: use DDP, FSDP2 or one process, or save_state(output_dir)"
            )
        if getattr(accelerator, "_resilience_handle", None) is not None:
            raise ConfigError("this Accelerator already has a ResilienceHandle: attach once, and close() it first")
        self.accelerator = accelerator
        self.plugin = plugin
        project = accelerator.project_configuration
        limit = project.total_limit
        config = plugin.checkpoint_config(
            local_dir=os.path.join(project.project_dir, "resilience") if project.project_dir else None,
            keep_last=max(2, limit) if limit else None,
        )
        if any(_updates_statistics_in_forward(model) for model in accelerator._models):
            # the background copy must also end before a forward that updates BatchNorm statistics
            config = dataclasses.replace(config, staging_barrier="forward")
        self.run_dir = os.fspath(plugin.run_dir or project.project_dir or config.local_root)
        self.ledger = GoodputLedger(
            self.run_dir,
            accelerator.process_index,
            span_s=float(plugin.goodput_span_s or 0),
            process_start=_incarnation_start(),
            write=bool(plugin.goodput) and accelerator.is_main_process,
        )
        self._telemetry = TrackerBridge(accelerator, self.ledger)
        self.manager = CheckpointManager(config, listeners=self._telemetry.listeners)
        self._interval = AutoInterval(plugin, accelerator, self.run_dir) if plugin.every_n_steps == AUTO else None
        self.data_monitor: LoaderMonitor | None = None
        self._guard: HealthGuard | None = None
        self._stop: Decision | None = None
        if health is not None or plugin.health:
            settings = health or HealthConfig(nvml=accelerator.device.type == "cuda")
            self._guard = HealthGuard(settings).start()  # collective; signal handlers need the main thread
        self.global_step = 0
        self._started = False
        self._boundary_step = 0
        self._staging_seen = 0.0
        self._last_saved: int | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._hooks: list[RemovableHandle] = []
        self._hooked: set[int] = set()
        self._training_loader = dataloader
        self._tracker: DataTracker | None = None
        self._warned_untracked = False
        self._originals = {name: getattr(accelerator, name) for name in _ROUTED}
        for name in _ROUTED:
            setattr(accelerator, name, getattr(self, f"_routed_{name}"))
        accelerator._resilience_handle = self
        self._closed = False
        if not accelerator._models and accelerator.is_main_process:
            warnings.warn(
                "attach() found no prepared model: call it after accelerator.prepare(...), so that step counting, "
                "interval saves and the data position are hooked before the first batch",
                stacklevel=3,
            )
        if accelerator._save_model_state_pre_hook and accelerator.is_main_process:
            warnings.warn(
                "Hooks registered with register_save_state_pre_hook are not called by accelerate_resilience's "
                "saves (they write into a folder; these saves are asynchronous); the models they see are in the "
                "checkpoint anyway. accelerator.save_state(<another folder>) still runs them, synchronously",
                stacklevel=3,
            )
        self._refresh()

    # ---- save -------------------------------------------------------------------------------------------------

    def save(self, step: int | None = None) -> SaveHandle | None:
        """Checkpoint everything now, in the background; collective (every rank, same step).

        Call it after a step's optimizer and scheduler steps: the checkpoint counts the batch just drawn as
        trained. ``step`` defaults to :attr:`global_step` (so numbering survives restarts). Returns None when
        nothing was saved: the step is the one saved last, or the previous save is still running and
        ``when_busy="skip"``.
        """
        self._check_open()
        start = time.perf_counter()
        self._end_step(start)  # called after a step's optimizer step: that step is complete
        staged = self._take_staging_wait()
        handle = self._save(step)
        self._take_staging_wait()  # waited for inside the save: part of its time
        self._blocked(staged + time.perf_counter() - start, saves=int(handle is not None))
        self.ledger.flush()
        return handle

    def _save(self, step: int | None = None) -> SaveHandle | None:
        self._refresh()
        self._telemetry.flush(self.global_step)
        step = self.global_step if step is None else int(step)
        if step == self._last_saved:
            return None
        position = self._position()
        rng, rng_at_next_batch = (
            (self._pending_rng, True) if self._pending_rng is not None else (capture_rng(), position.rng_at_next_batch)
        )
        progress = {
            "global_step": step,
            "epoch": position.epoch,
            "batch_in_epoch": position.batch_in_epoch,
            "accelerator_step": self.accelerator.step,
        }
        state = {"training": training_state(self.accelerator), "progress": progress}
        rank_state = {
            "rng": rng,
            "rng_at_next_batch": rng_at_next_batch,
            "objects": object_states(self.accelerator),
            "loaders": loader_states(self.accelerator._dataloaders),
        }
        handle = self.manager.save(step, state, rank_state, extra={"adapter": "accelerate", **progress})
        if handle is not None:
            self._last_saved = step
        return handle

    def wait(self, *, durable: bool = False) -> None:
        """Block until the last save is committed locally (and uploaded, with ``durable``); raise its error."""
        start = time.perf_counter()
        self.manager.wait(durable=durable)
        self._blocked(time.perf_counter() - start, saves=0)
        self._telemetry.flush(self.global_step)

    # ---- data -------------------------------------------------------------------------------------------------

    def timed(self, loader: Iterable[T]) -> TimedIterator[T]:
        """``loader``, timing how long each ``next()`` blocks: the accelerator's wait for data.

        Use it in the training loop (``for batch in resilience.timed(train_dl)``); it keeps the loader's
        length and attributes, and the handle still tracks the position of the loader inside. Per window of
        ``plugin.data_window_steps`` steps, logs ``data/wait_fraction``, ``data/samples_per_s``,
        ``data/step_ms``, ... and the ledger's ``goodput/*`` figures; above ``plugin.starvation_threshold`` it
        warns with the likely cause (workers, I/O, collate). The waits go to the ledger's data-wait bucket.
        Only the time spent waiting counts: loading that overlaps the step (workers, prefetching) does not,
        nor does the handle's own work at the batch boundary (saves, health checks).
        """
        if self.data_monitor is None:
            self.data_monitor = LoaderMonitor(
                self.plugin, self.accelerator.process_index, self.ledger, self._log_window
            )
        # Accelerate's loaders pass attributes through to the DataLoader they wrap, but not assignments: its
        # collate_fn is timed (in-process) on the DataLoader itself.
        self.data_monitor.watch(getattr(loader, "base_dataloader", loader))
        return TimedIterator(loader, self.data_monitor, on_wait=self.data_monitor.fetched)

    # ---- resume -----------------------------------------------------------------------------------------------

    def resume(self, step: int | None = None) -> ResumePoint:
        """Load the newest checkpoint that verifies (or ``step``) into everything prepared; collective.

        Restores models, optimizers, schedulers, GradScaler, registered objects (per rank), RNG (per rank),
        data loaders (epoch counter; StatefulDataLoader cursor) and the step counters. Returns a zero
        :class:`ResumePoint` with ``restored=False`` when there is no checkpoint yet.
        """
        self._check_open()
        start = time.perf_counter()
        self._refresh()
        self.manager.wait_for_staging()  # the load fills the live tensors in place
        restored = self.manager.load({"training": training_state(self.accelerator)}, step=step)
        if restored is None:
            self._resumed(None, start)
            return ResumePoint()
        where = f"checkpoint step {restored.step} ({restored.path})"
        load_training_state(self.accelerator, restored.state["training"], where)
        progress = restored.state["progress"]
        self.global_step = self._last_saved = restored.step
        self.accelerator.step = progress["accelerator_step"]
        rank_state = restored.rank_state
        if restored.manifest.world_size != self.accelerator.num_processes:
            rank_state = None
            if self.accelerator.is_main_process:
                warnings.warn(
                    f"{where} was saved by {restored.manifest.world_size} processes and this run has "
                    f"{self.accelerator.num_processes}: models, optimizers and schedulers are restored (resharded), "
                    "but per-rank RNG, data loader cursors and registered objects are not; the resumed epoch "
                    "skips its trained batches with the new sharding",
                    stacklevel=2,
                )
        if rank_state is not None:
            load_object_states(self.accelerator, rank_state["objects"], where)
            load_loader_states(self.accelerator._dataloaders, rank_state["loaders"], where)
        epoch, batch = progress["epoch"], progress["batch_in_epoch"]
        positioned = rank_state is not None and self._tracker is not None and self._tracker.stateful
        if self._tracker is not None:
            self._tracker.resume_at(epoch, batch, positioned=positioned)
        self._pending_rng = None
        if rank_state is not None:
            if rank_state["rng_at_next_batch"] and self._tracker is not None:
                self._pending_rng = rank_state["rng"]
            else:
                restore_rng(rank_state["rng"])
        log.info("resumed from %s at epoch %d, batch %d, global step %d", where, epoch, batch, restored.step)
        self._resumed(restored.step, start)
        return ResumePoint(
            epoch=epoch,
            batch_in_epoch=batch,
            global_step=restored.step,
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
        return self._stop is not None

    def close(self) -> None:
        """Finish every queued write and upload, log the last events, and give the Accelerator its methods back.

        Ends this incarnation in the goodput ledger as completed. After an agreed stop (:meth:`should_stop`),
        ends it as stopped instead, and exits with the stop's code (``SystemExit``).
        """
        self._close(None)

    def _close(self, failure: BaseException | None) -> None:
        if not self._closed:
            self._closed = True
            start = time.perf_counter()
            self._end_step(start)  # the last step: no batch after it ended it
            try:
                self.manager.close()
            except BaseException as exc:
                failure = failure or exc
                raise
            finally:
                self._release()
                self._end(time.perf_counter() - start, failure)
        if self._stop is not None and self._guard is not None:
            for tracker in self.accelerator.trackers:  # what end_training would do; the group goes with the process
                tracker.finish()
            self._guard.stop()

    def _release(self) -> None:
        self._telemetry.flush(self.global_step)
        for hook in self._hooks:
            hook.remove()
        if self._tracker is not None:
            self._tracker.detach()
        for name in _ROUTED:
            self.accelerator.__dict__.pop(name, None)
        self.accelerator._resilience_handle = None
        if self._guard is not None and self._stop is None:
            self._guard.close()  # while the default process group still exists (end_training destroys it)

    def _end(self, closing_s: float, failure: BaseException | None) -> None:
        """Close the ledger; only a normal end is ``completed``, anything else counts as a failure."""
        closing_s += self._take_staging_wait()
        if self._stop is not None:
            self.ledger.emergency(closing_s, "the stop's last writes and uploads")
            reason = f"stopped, exit code {self._stop.exit_code}: {self._stop.reason}"
        else:
            self._blocked(closing_s, saves=0)  # the last saves' writes and uploads
            reason = COMPLETED if failure is None else f"{type(failure).__name__}: {failure}"
        self.ledger.end(reason[:200])
        self._telemetry.close()

    def __enter__(self) -> ResilienceHandle:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        self._close(exc)

    # ---- what the accelerator prepared ------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Hook whatever was prepared since the last call: step counting and the training loader."""
        accelerator = self.accelerator
        if accelerator._optimizers and id(accelerator._optimizers[0].optimizer) not in self._hooked:
            optimizer = accelerator._optimizers[0].optimizer
            self._hooked.add(id(optimizer))
            self._hooks.append(optimizer.register_step_post_hook(self._count_step))
        if self._tracker is None:
            loader = self._training_loader
            if loader is None:
                loader = next(iter(accelerator._dataloaders), None)
            if loader is not None and trackable(loader):
                self._tracker = DataTracker(loader, self._on_batch)
                if getattr(loader, "synchronized_generator", None) is not None and accelerator.is_main_process:
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
        self.global_step += 1

    def _position(self) -> Position:
        return self._tracker.position() if self._tracker is not None else Position(0, 0, rng_at_next_batch=False)

    def _on_batch(self) -> None:
        """Just before the training loader hands out a batch: the previous step is complete."""
        start = time.perf_counter()
        try:
            self._step_boundary(start)
        finally:
            if self.data_monitor is not None:
                self.data_monitor.hook_ran(time.perf_counter() - start)

    def _step_boundary(self, now: float) -> None:
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None
        if not self._started:
            self._start_training(now)
        self._end_step(now)
        self._telemetry.flush(self.global_step)
        if self._guard is not None:
            if self._stop is not None:  # the loop went on after should_stop(): stop it here
                self.close()
            decision = self._guard.on_step(self.global_step)
            if decision.stop:
                start = time.perf_counter()
                self._guard.emergency_save(self.manager, self.global_step, save=self._save)
                self._take_staging_wait()  # waited for inside the emergency save: part of its time
                self.ledger.fault(decision.reason, decision.step)
                self.ledger.emergency(time.perf_counter() - start, f"emergency save of step {self.global_step}")
                self._stop = decision
                return
            if decision.save:
                self.save()
        every = self.plugin.every_n_steps
        if self._interval is not None:
            if self._interval.due(self.global_step):
                if self.global_step != self._last_saved:
                    self.save()
                self._plan_interval()
        elif (
            isinstance(every, int)
            and self.global_step > 0
            and self.global_step % every == 0
            and self.global_step != self._last_saved
        ):
            self.save()

    def _start_training(self, now: float) -> None:
        self._started = True
        self._boundary_step = self.global_step
        self.ledger.startup_done()
        if self._interval is not None:
            self._interval.start(self.global_step, now)

    def _end_step(self, now: float) -> None:
        """Count the optimizer step done since the last boundary, if any (not every micro-batch is a step)."""
        if not self._started or self.global_step == self._boundary_step:
            return
        self._boundary_step = self.global_step
        self._blocked(self._take_staging_wait(), saves=0)  # before the step ends: it waited inside the step
        self.ledger.step_end(self.global_step)
        if self._interval is not None:
            self._interval.step_done(now)

    def _plan_interval(self) -> None:
        assert self._interval is not None
        plan = self._interval.replan(self.global_step, time.perf_counter())
        self._telemetry.log(self._interval.metrics(), self.global_step)
        if self.accelerator.is_main_process:
            log.info("every_n_steps='auto': %s", plan.describe())

    def _resumed(self, step: int | None, start: float) -> None:
        self._take_staging_wait()  # waited for inside the restore: part of its time
        self.ledger.restored(step, time.perf_counter() - start)
        if not self._started:
            self._start_training(time.perf_counter())

    def _take_staging_wait(self) -> float:
        """Seconds waited for asynchronous copies since the last call (before an optimizer step, in a save)."""
        total = self.manager.stats.staging_wait_s
        waited, self._staging_seen = total - self._staging_seen, total
        return waited

    def _blocked(self, seconds: float, *, saves: int) -> None:
        """Training waited ``seconds`` for checkpoints: the ledger's stall, and the "auto" interval's cost."""
        if seconds > 0:
            self.ledger.checkpoint_stall(seconds, self.global_step)
        if self._interval is not None:
            self._interval.blocked(seconds, saves)

    def _log_window(self, window: DataWindow) -> None:
        self._telemetry.log({**window.metrics(), **self.ledger.metrics()}, self.global_step)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this ResilienceHandle is closed; attach a new one")

    @property
    def interval_plan(self) -> IntervalPlan | None:
        """With ``every_n_steps="auto"``: the current plan (the same on every rank); None before the first save."""
        return self._interval.plan if self._interval is not None else None

    # ---- Accelerator methods routed here ----------------------------------------------------------------------

    def _is_ours(self, location: str | os.PathLike[str]) -> bool:
        text = os.fspath(location)
        if text == self.manager.config.durable_url:
            return True
        return "://" not in text and os.path.abspath(os.path.expanduser(text)) == os.path.abspath(
            self.manager.config.local_root
        )

    def _routed_save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> SaveHandle | None:
        if output_dir is None or self._is_ours(output_dir):
            return self.save()
        if "://" in os.fspath(output_dir):
            raise ConfigError(
                f"save_state({os.fspath(output_dir)!r}): Accelerate would write this URL as a local folder. Set "
                "ResiliencePlugin(durable_url=...) (or ACCELERATE_RESILIENCE_DURABLE_URL) and call save_state()"
            )
        return self._originals["save_state"](output_dir, safe_serialization=safe_serialization, **kwargs)

    def _routed_load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> ResumePoint | None:
        if input_dir is None or self._is_ours(input_dir):
            return self.resume()
        if "://" in os.fspath(input_dir):
            raise ConfigError(
                f"load_state({os.fspath(input_dir)!r}): only this run's durable_url "
                f"({self.manager.config.durable_url}) is read through the engine; attach a plugin with that URL"
            )
        return self._originals["load_state"](input_dir, load_kwargs=load_kwargs, **kwargs)

    def _routed_skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, TimedIterator):  # skip in the loader it times, and time the result
            inner = self._routed_skip_first_batches(dataloader.iterable, num_batches)
            return dataloader if inner is dataloader.iterable else self.timed(inner)
        tracker = self._tracker
        if tracker is None or dataloader is not tracker.loader:
            return self._originals["skip_first_batches"](dataloader, num_batches)
        if num_batches == 0:  # Accelerate would rebuild the loader, dropping a StatefulDataLoader's cursor
            return dataloader
        child = self._originals["skip_first_batches"](dataloader, num_batches)
        tracker.follow_skip(child, num_batches)
        return child

    def _routed_end_training(self) -> None:
        original = self._originals["end_training"]
        self.close()  # before the process group goes: the last saves still need it (exits after a stop)
        original()


def _incarnation_start() -> float | None:
    """The first ledger of a process starts at the process's start (imports count as startup); later ones now."""
    global _process_accounted
    first, _process_accounted = not _process_accounted, True
    return None if first else time.time()


def _updates_statistics_in_forward(model: torch.nn.Module) -> bool:
    return any(isinstance(m, _NormBase) and m.track_running_stats for m in model.modules())


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
            the defaults: NVML on CUDA, SIGTERM/SIGUSR1 as preemption, the hang watchdog).
    """
    return ResilienceHandle(accelerator, plugin if plugin is not None else ResiliencePlugin(), dataloader, health)
