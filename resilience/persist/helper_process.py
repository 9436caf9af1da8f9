"""A persist helper's own loop: this rank's part of the pipeline, run in a helper process on what the training
process sends (:class:`~resilience.persist.helper.HelperPipeline` is the other end).

It runs the same :class:`~resilience.persist.pipeline.Pipeline` the training process would otherwise run as
threads, over the training process's staging buffers mapped in place by segment name; every save's futures,
events and errors go back over the connection as they happen. The fork server imports this module, DCP with it,
before it forks anything: each helper shares those pages instead of importing DCP again for itself.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from resilience.checkpoint.save_events import SaveEvents
from resilience.checkpoint.save_handle import Commit, SaveHandle
from resilience.checkpoint.staging import SegmentRef, StagingJob, attach
from resilience.dist import Groups
from resilience.errors import CheckpointError, describe
from resilience.persist.pipeline import Pipeline, WriteJob, WriteSpec
from resilience.persist.worker import Worker
from resilience.storage.tiers import DurableTier, LocalTier

if TYPE_CHECKING:
    from concurrent.futures import Future

    from resilience.persist.helper import HelperSettings

Send = Callable[[tuple[Any, ...]], None]


@dataclass(frozen=True)
class Piece:
    """A DTensor's local shard where there is no device mesh (the helper): its DCP write items were made by the
    training process from the real DTensor, so the global layout is kept and loads reshard as usual."""

    local: torch.Tensor
    items: list[Any]

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        return self.items


def serve_pipeline(conn: Connection, settings: HelperSettings) -> None:
    """Run this rank's part of the pipeline on what the training process sends, until told to close."""
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    send(("ready", os.getpid()))
    _join_helpers(settings)
    protected: set[int] = set()
    pipeline = _pipeline(settings, send, lambda: set(protected))
    calls = Worker("resilience-helper-calls", lambda queue: _answer_next(calls, send))
    buffers: dict[str, torch.Tensor] = {}
    mapped: dict[str, torch.Tensor] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the training process is gone: nothing more will come
        kind = message[0]
        if kind == "buffers":
            refs: dict[str, SegmentRef] = message[1]
            for key, ref in refs.items():  # the training process's staging buffers, read in place
                buffers[key] = attach(ref, mapped)
        elif kind == "write":
            spec, keys, protected = message[1], message[2], set(message[3])
            pipeline.submit(_job(spec, {k: buffers[k] for k in keys}, send))
        elif kind == "call":  # beside the saves, in a thread of its own: a name's write, after its step's commit
            calls.put(message[1:])
        elif kind == "retain":
            protected = set(message[1])
            pipeline.close()
            pipeline.retain()
        elif kind == "close":
            calls.join(None)
            pipeline.close()
            send(("closed",))
            return


def _answer_next(calls: Worker, send: Send) -> None:
    """Run the next function the training process sent, and send back what it returned or raised."""
    with calls.cond:
        number, function = calls.items.pop(0)
    send(("called", number, *call_result(function)))


def call_result(function: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """``function(*args, **kwargs)``'s result as it crosses back: ("ok", result), or ("error", (the pickled
    exception, its description)) (:func:`returned` takes it apart)."""
    try:
        return "ok", function(*args, **kwargs)
    except BaseException as exc:
        return error_result(exc)


def error_result(exc: BaseException) -> tuple[str, Any]:
    """``exc`` as :func:`call_result` sends it back."""
    return "error", (pickled_error(exc), describe(exc))


def returned(kind: str, payload: Any) -> Any:
    """The result :func:`call_result` sent, or its exception raised (as a :class:`CheckpointError` with its
    description, where the exception's type does not unpickle)."""
    if kind != "error":
        return payload
    data, text = payload
    try:
        error = pickle.loads(data)
    except Exception:  # an exception type whose arguments do not survive pickling
        error = CheckpointError(text)
    raise error


def _join_helpers(settings: HelperSettings) -> None:
    """The helpers of all ranks form a gloo group of their own, through the store rank 0's training process hosts."""
    topology = settings.topology
    if topology.world_size == 1:
        return
    timeout = timedelta(seconds=settings.config.collective_timeout_s)
    store = dist.TCPStore(settings.store_host, settings.store_port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"resilience-helpers/{settings.generation}", store)
    dist.init_process_group("gloo", store=prefixed, rank=topology.rank, world_size=topology.world_size, timeout=timeout)


def _pipeline(settings: HelperSettings, send: Send, protected_steps: Callable[[], set[int]]) -> Pipeline:
    """The pipeline a training process would run as threads, reporting over the connection."""
    config, topology = settings.config, settings.topology
    groups = Groups(config.collective_timeout_s, topology.nodes[topology.rank])
    return Pipeline(
        config,
        LocalTier(config.local_root),
        DurableTier(config.durable_url, config.storage_options) if config.durable_url else None,
        topology,
        groups.writer,
        groups.upload,
        settings.local_shared,
        SaveEvents(topology.rank, [lambda record: send(("event", record))]),
        lambda step: send(("known", step)),
        protected_steps,
        on_error=lambda error: send(("error", pickled_error(error))),
    )


def _job(spec: WriteSpec, staged: dict[str, torch.Tensor], send: Send) -> WriteJob:
    """A save received, as a job for this helper's pipeline: its tensors are the mapped buffers (a DTensor's
    shard as a :class:`Piece`), and its handle's futures are sent back as they resolve."""
    handle = SaveHandle(spec.step)
    handle.committed.add_done_callback(_forward("committed", spec.step, handle, send))
    handle.durable.add_done_callback(_forward("durable", spec.step, handle, send))
    tensors = {k: Piece(t, spec.pieces[k]) if k in spec.pieces else t for k, t in staged.items()}
    return WriteJob.of(spec, StagingJob(tensors), handle)  # type: ignore[arg-type]


def _forward(kind: str, step: int, handle: SaveHandle, send: Send) -> Callable[[Future[Any]], None]:
    def done(future: Future[Any]) -> None:
        error = future.exception()
        result: Commit | bytes | None = pickled_error(error) if error is not None else future.result()
        send((kind, step, result, dict(handle.timings)))

    return done


def pickled_error(exc: BaseException) -> bytes:
    """An exception as it crosses back to the training process: itself, or if it does not pickle, its description."""
    try:
        return pickle.dumps(exc)
    except Exception:
        return pickle.dumps(CheckpointError(describe(exc)))


def unpickled_error(data: bytes) -> CheckpointError:
    """An error from :func:`pickled_error`, as the engine raises it."""
    exc = pickle.loads(data)
    return exc if isinstance(exc, CheckpointError) else CheckpointError(describe(exc))
