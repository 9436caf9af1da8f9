"""Names: the checkpoint files a framework reports (Lightning's ``.ckpt``), written from committed steps.

``ModelCheckpoint`` and ``trainer.save_checkpoint(path)`` name, rank, link and delete checkpoint *files*, and
users load those files with ``Model.load_from_checkpoint``, ``torch.load`` or a Trainer without this pack. The
engine keeps each checkpoint as a committed ``step-<N>`` directory (the single source of truth, written in
parallel by every rank); a name is materialised from it only after its local commit, in the background on
rank 0, into a temporary file in ``torch.save``'s format that is then renamed over the name. The tensors come
from the staging buffers the step was written from, which the save lends to the name's writer (the next save
waits for them back: :meth:`CheckpointManager.lend_staged`), and whatever those do not hold (other ranks'
shares, a step of an earlier run) is streamed back from the step's files a few tensors at a time. So a name
never exists before its data is committed, never holds a partly written file, never needs a second copy of
the state in memory, and seldom reads back what was just written (its files went past the page cache).

Under a sharded strategy a name is instead Lightning's sharded checkpoint directory, made from the committed
step without writing its tensors again (:mod:`resilience.formats.lightning_sharded`); for Accelerate's automatic
checkpoint naming, the folder its ``save_state`` writes (:mod:`resilience.formats.accelerate_folder`); for the Hugging
Face Trainer, its ``checkpoint-<N>`` folder (:mod:`resilience.formats.trainer_folder`).

Names are recorded in ``<local_root>/names.json`` (path, step, what was asked for), so that a name still being
written is waited for by a load, a name whose process died before writing it is written at the next start,
and a load of a missing name can fall back to the step it was for (:func:`resolve`). None of this imports
the framework: the adapter only says when a name is asked for, removed or loaded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from resilience.checkpoint.save_handle import SaveHandle
from resilience.checkpoint.staging import Loan
from resilience.formats import accelerate_folder, trainer_folder
from resilience.formats.export import METADATA_KEY, remove_stale_temporaries, write_file_atomically, write_name
from resilience.formats.lightning_ckpt import is_weights_only
from resilience.formats.lightning_sharded import remove_name, write_sharded_name
from resilience.persist.worker import Worker
from resilience.storage import catalog
from resilience.storage.layout import MANIFEST, parse_step_dirname
from resilience.storage.tiers import LocalTier, Tier

if TYPE_CHECKING:
    import torch

    from resilience.checkpoint.manager import CheckpointManager
    from resilience.config import CheckpointConfig

log = logging.getLogger(__name__)
REGISTRY = "names.json"
FILE = "file"  # a name's layout: one Lightning checkpoint file
SHARDED = "sharded"  # Lightning's sharded checkpoint directory (DCP files and meta.pt)
# and folders made from a step, by layout: Accelerate's save_state folders, the Trainer's checkpoint-N
FOLDERS: dict[str, Callable[..., None]] = {
    accelerate_folder.SAFETENSORS: functools.partial(accelerate_folder.write_accelerate_folder, safetensors=True),
    accelerate_folder.PICKLED: functools.partial(accelerate_folder.write_accelerate_folder, safetensors=False),
    trainer_folder.LAYOUT: trainer_folder.write_trainer_folder,
}

# A name meaning "the newest committed checkpoint that verifies" (AutoResume's). A JSON file, named as one: a
# ".ckpt" name made users try torch.load on it. Roots written before keep their "resume.ckpt", still read as one.
RESUME_MARKER = "resume.json"
_OLD_RESUME_MARKER = "resume.ckpt"
_MARKER_FORMAT = "training-resilience/resume"


@dataclass
class Name:
    """One name: where, which step, which top-level keys of the checkpoint dict, its layout, whether it is written."""

    path: str
    step: int
    keys: list[str]
    run_id: str | None = None
    written: bool = False
    layout: str = FILE


class NameWriter:
    """Writes names from committed steps, one at a time, off the training thread (rank 0 only).

    Args:
        local: The engine's local tier (the step directories are read from it).
        allow_pickle: Whether a name rewritten after a restart may unpickle what its step holds.
        off_process: Runs a name's write in another process and waits for it (the engine's
            ``persist="process"``: :meth:`CheckpointManager.call_off_process`, the rank's helper), or None:
            here. Serialising the state and reading back what the staging buffers do not hold would otherwise
            compete with the training thread for the interpreter lock; this thread only waits.
        lend: The staged tensors of a save, lent until given back (the manager's ``lend_staged``), or None.
    """

    def __init__(
        self,
        local: LocalTier,
        *,
        allow_pickle: bool = False,
        off_process: Callable[[Callable[[], None]], None] | None = None,
        lend: Callable[[SaveHandle], Loan | None] | None = None,
    ):
        self.local = local
        self.allow_pickle = allow_pickle
        self.off_process = off_process
        self.lend = lend
        self._path = os.path.join(local.root, REGISTRY)
        self._lock = threading.Lock()
        self._names: dict[str, Name] = self._read()
        self._pending: dict[str, Future[None]] = {}
        self._worker = Worker("resilience-names", self._next)
        self._options: dict[str, dict[str, Any]] = {}

    # ---- what the IO calls -----------------------------------------------------------------------------------

    def add(
        self,
        path: str,
        step: int,
        keys: list[str],
        handle: SaveHandle | None,
        run_id: str | None,
        storage_options: dict[str, Any] | None = None,
        layout: str = FILE,
    ) -> Future[None]:
        """Write ``path`` from step ``step`` once ``handle`` is committed (None: it already is). Call before the
        next save, so that a file name gets ``handle``'s staged tensors on loan.

        ``storage_options``: fsspec options for a ``path`` that is a URL (Lightning's per-save argument).
        ``layout``: :data:`FILE` or :data:`SHARDED`.
        """
        path = _absolute(path)
        name = Name(path, step, list(keys), run_id, layout=layout)
        self._options[path] = dict(storage_options or {})
        if (
            "://" not in path
        ):  # the folder is there at once, as Lightning's own save leaves it (save_last links into it)
            os.makedirs(os.path.dirname(path), exist_ok=True)
        future: Future[None] = Future()
        # a URL is uploaded after its file is written: the buffers are not held for that long
        loan = self.lend(handle) if self.lend and handle and layout == FILE and "://" not in path else None
        with self._lock:
            self._names[path] = name
            self._store()
            self._pending[path] = future
        self._worker.put((name, handle, future, loan))
        return future

    def _done(self, name: Name, future: Future[None]) -> None:
        with self._lock:
            if self._pending.get(name.path) is future:
                self._pending.pop(name.path)

    def written(self, path: str, step: int, keys: list[str], run_id: str | None) -> None:
        """Record a name the caller wrote itself (a save outside ``fit()`` writes its file at once)."""
        path = _absolute(path)
        with self._lock:
            self._names[path] = Name(path, step, list(keys), run_id, written=True)
            self._store()

    def metadata(self, step: int, run_id: str | None) -> dict[str, Any]:
        """What every file made from an engine step carries: which run and step it came from."""
        return {METADATA_KEY: {"step": step, "run_id": run_id, "local_root": self.local.root}}

    def pending(self, path: str) -> Future[None] | None:
        with self._lock:
            return self._pending.get(_absolute(path))

    def lookup(self, path: str) -> Name | None:
        with self._lock:
            return self._names.get(_absolute(path))

    def recorded(self) -> list[Name]:
        with self._lock:
            return list(self._names.values())

    def pending_steps(self) -> set[int]:
        """Steps a name still has to be written from (retention must keep them)."""
        with self._lock:
            return {name.step for name in self._names.values() if not name.written}

    def forget(self, path: str) -> None:
        """``ModelCheckpoint`` removed the name: delete it (after a write in flight) and its record."""
        path = _absolute(path)
        future = self.pending(path)
        if future is not None:
            with contextlib.suppress(Exception):
                future.result()
        with self._lock:
            self._names.pop(path, None)
            self._pending.pop(path, None)
            self._store()
        remove_name(path)

    def repair(self, committed: set[int]) -> None:
        """Queue the names a dead process never wrote, whose steps are committed (call at start-up)."""
        with self._lock:
            missing = [n for n in self._names.values() if not n.written or not os.path.exists(n.path)]
        for name in missing:
            for leftover in remove_stale_temporaries(name.path):  # the temporary file of the writer that died
                log.info("removed %s, left by a writer of %s that died mid-file", leftover, name.path)
            if name.step in committed:
                log.info("writing %s (step %d), which the previous run did not finish", name.path, name.step)
                self.add(name.path, name.step, name.keys, None, name.run_id, layout=name.layout)

    def wait(self) -> None:
        """Every name asked for so far is written (or its error raised)."""
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:
            future.result()

    # ---- the background write ------------------------------------------------------------------------------

    def _next(self, queue: list[tuple[Name, SaveHandle | None, Future[None], Loan | None]]) -> None:
        with self._worker.cond:
            name, handle, future, loan = queue.pop(0)
        try:
            self._write(name, handle, loan)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            self._done(name, future)
            future.set_result(None)
        finally:
            if loan is not None:
                loan.give_back()

    def _write(self, name: Name, handle: SaveHandle | None, loan: Loan | None) -> None:
        with self._lock:
            if self._names.get(name.path) is not name:
                return  # a later save of the same path (save_last, a re-saved top-k name) supersedes this one
        if handle is None and not self.local.exists(self.local.step_path(name.step, MANIFEST)):
            # a repair whose step went since it was queued: a fresh run set it aside (superseded/), or retention
            # deleted it. There is nothing to write it from, and nothing of this run is lost: forget the name.
            log.warning("not writing %s: its step %d is no longer in %s", name.path, name.step, self.local.root)
            with self._lock:
                if self._names.get(name.path) is name:
                    self._names.pop(name.path)
                    self._store()
            return
        try:
            if handle is not None:
                handle.committed.result()  # a failed save names nothing; its error is raised here and there
            # This process hashed these files while writing them, and pickled what they hold; a repair after a
            # restart checks them again, and unpickles only with the plugin's consent.
            fresh = handle is not None
            allow_pickle = fresh or self.allow_pickle
            if name.layout == SHARDED:
                extra = self.metadata(name.step, name.run_id)
                write_sharded_name(
                    self.local,
                    name.step,
                    name.path,
                    name.keys,
                    verify=not fresh,
                    allow_pickle=allow_pickle,
                    extra=extra,
                )
            else:
                if name.layout in FOLDERS:
                    write = functools.partial(
                        FOLDERS[name.layout],
                        self.local,
                        name.step,
                        name.path,
                        verify=not fresh,
                        allow_pickle=allow_pickle,
                    )
                else:
                    held: Mapping[str, torch.Tensor] | None = loan.tensors if loan is not None else None
                    if loan is not None and self.off_process is not None:
                        held = loan.by_segment()  # mapped by the helper; None: not in shared memory, read back
                    write = functools.partial(
                        write_name,
                        self.local,
                        name.step,
                        name.path,
                        name.keys,
                        self.metadata(name.step, name.run_id),
                        verify=not fresh,
                        allow_pickle=allow_pickle,
                        storage_options=self._options.get(name.path),
                        held=held,
                    )
                if self.off_process is not None:
                    self.off_process(write)  # again elsewhere, if the helper was ended mid-file:
                    for leftover in remove_stale_temporaries(name.path):  # its temporary file stays behind
                        log.info("removed %s, left by a writer of %s that was ended mid-file", leftover, name.path)
                else:
                    write()
        except BaseException:
            log.exception("writing the checkpoint file %s failed", name.path)
            raise
        with self._lock:
            if self._names.get(name.path) is name:
                name.written = True
                self._store()

    # ---- the record ----------------------------------------------------------------------------------------

    def _read(self) -> dict[str, Name]:
        try:
            with open(self._path) as stream:
                body = json.load(stream)
            return {item["path"]: Name(**item) for item in body.get("names", [])}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring the unreadable name record %s (%s)", self._path, exc)
            return {}

    def _store(self) -> None:
        tmp = f"{self._path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as stream:
                json.dump({"names": [asdict(n) for n in self._names.values()]}, stream, indent=1)
            os.replace(tmp, self._path)
        except OSError as exc:  # a full disk must not stop training; names are written all the same
            log.warning("could not update %s: %s", self._path, exc)


def repaired_writer(manager: CheckpointManager) -> NameWriter | None:
    """Rank 0's writer for ``manager``'s run (None on the other ranks), with the names a dead process left
    unwritten queued again at once."""
    if manager.rank != 0:
        return None
    names = NameWriter(
        manager.local,
        allow_pickle=manager.config.allow_pickle,
        off_process=manager.call_off_process if manager.config.persist == "process" else None,
        lend=manager.lend_staged,
    )
    names.repair(manager.committed_steps())
    return names


def _recorded(config: CheckpointConfig) -> NameWriter | None:
    """The names recorded under the local root, for a process that writes none (other ranks look steps up in
    it); None where the folder cannot be read."""
    with contextlib.suppress(OSError):
        return NameWriter(LocalTier(config.local_root), allow_pickle=config.allow_pickle)
    return None


def publish(
    names: NameWriter | None,
    path: str,
    step: int,
    checkpoint: dict[str, Any],
    handle: SaveHandle | None,
    run_id: str | None,
    layout: str = FILE,
    storage_options: dict[str, Any] | None = None,
    write: Callable[[dict[str, Any]], None] | None = None,
    *,
    now: bool,
) -> None:
    """Name step ``step`` ``path``, for a framework's save of ``checkpoint`` that ``handle`` (None: skipped) makes.

    ``names`` is rank 0's writer (None on the other ranks, which wait as it does). With ``now`` the name exists
    when this returns: written from the dict in hand, by ``write`` once the step is committed, or by default
    (:func:`write_file_atomically`) while it commits, and renamed into place once it has; otherwise (and always
    for :data:`SHARDED`) it is made from the committed step in the background, which ``now`` then waits for.
    """
    keys = list(checkpoint)
    if layout == SHARDED or not now:
        if handle is None:  # skipped (when_busy="skip"): no step to name
            return
        written = names.add(path, step, keys, handle, run_id, storage_options, layout) if names else None
        if now:
            (written or handle.committed).result()
        return
    committed = handle.committed.result if handle is not None else None
    if names is None:
        if committed is not None:
            committed()
        return
    named = {**checkpoint, **names.metadata(step, run_id)}
    if write is None:  # written while the step commits; it becomes the name after, or not if the commit fails
        write_file_atomically(named, path, storage_options=storage_options, ready=committed)
    else:
        if committed is not None:
            committed()
        write(named)
    names.written(path, step, keys, run_id)


def _absolute(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def resolve(
    path: str, names: NameWriter | None, config: CheckpointConfig, *, partial: Callable[[list[str]], bool] | None = None
) -> tuple[int | None, str | None]:
    """(step to load from the engine, None: the newest that verifies) or (None, path of a plain checkpoint file).

    ``names``: rank 0's writer (a load of a name still being written waits for it); without one, the names
    recorded under ``config``'s local root. ``partial``: whether a name with these top-level keys holds less than
    its step, so its file is what to load (default: Lightning's weights-only names). No collectives: a sharded
    strategy resolves on rank 0 only and broadcasts the answer.
    """
    partial = partial or (lambda keys: is_weights_only(dict.fromkeys(keys)))
    if os.path.basename(path) in (RESUME_MARKER, _OLD_RESUME_MARKER) and _is_marker(path):
        return None, None
    step = parse_step_dirname(path)
    if step is not None and os.path.isdir(path):
        return step, None
    names = names or _recorded(config)
    name = names.lookup(path) if names is not None else None
    pending = names.pending(path) if names is not None else None
    if pending is not None:
        pending.result()  # a save of this path is in flight: load what it writes, once it is written
    if name is not None and not partial(name.keys) and _held(name.step, config.tiers()):
        return name.step, None  # the engine's copy: verified, and every rank's own state
    if os.path.exists(os.path.realpath(path)) or "://" in path:
        return None, path
    if name is not None:
        log.warning("%s was never written (its process ended first); loading step %d", path, name.step)
        return name.step, None
    raise FileNotFoundError(f"Checkpoint {path} does not exist: pass an existing file, or ckpt_path='last'")


def remove(names: NameWriter | None, path: str) -> None:
    """The framework removed the name ``path``: delete it, and with rank 0's writer its record (after a write in
    flight); the step stays until retention, which never deletes one mid-save."""
    if names is not None:
        names.forget(path)
    else:
        remove_name(path)


def _held(step: int, tiers: list[Tier]) -> bool:
    """Whether the engine still has ``step`` (retention may have deleted it; its name is a checkpoint itself)."""
    return any(entry.step == step for entry in catalog.candidates(tiers))


def write_resume_marker(local_root: str | os.PathLike[str]) -> str:
    """The name that :func:`resolve` reads as "the newest committed checkpoint that verifies"."""
    path = os.path.join(local_root, RESUME_MARKER)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as stream:
        note = "not a checkpoint: AutoResume's pointer to the newest committed checkpoint that verifies in this folder"
        stream.write(json.dumps({"format": _MARKER_FORMAT, "note": note}) + "\n")
    os.replace(tmp, path)
    return path


def _is_marker(path: str) -> bool:
    try:
        with open(path) as stream:
            return _MARKER_FORMAT in stream.read(256)
    except OSError:
        return False
