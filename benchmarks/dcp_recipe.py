"""The strongest recipe a user would pick instead of ours: DCP's process-based async save with a persistent stager.

Since torch 2.9, ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS,
async_stager=DefaultStager(StagingOptions(...)))`` is what torchtitan runs for ``async_with_pinned_mem`` and what
Lightning's open proposal for a DCP-based asynchronous CheckpointIO wraps. ``DcpProcessSaver`` is that recipe done
the way a demanding user would, so that the benchmarks compare ours with its best, not with a careless use of it:

- one ``DefaultStager`` for the whole run, made at the first save (as torchtitan does) and reused by every save:
  it keeps one host copy of each storage and copies into it again, so only the first save allocates. Its options:
  shared memory (the copy is handed to DCP's process without another copy), asynchronous staging (the copy runs in
  a thread while training goes on), and, when the state is on a GPU, pinned memory and non-blocking copies;
- a gloo process group of its own for the checkpoint collectives (``dist.new_group(backend="gloo")``, as
  torchtitan), over a one-rank gloo group made here when no group exists: the process mode needs one even in a
  single process (it finds its process's port through it);
- each save first waits for the previous save's upload: DCP keeps no queue, and a second save in flight would
  stage into the buffers the first is still writing from and talk to DCP's one process while it is busy;
- the next optimizer update waits for the staging copy (``wait_for_staging``, to be called just before
  ``optimizer.step()`` changes the parameters, as torchtitan's trainer does); the benchmarks count that wait in a
  save's blocking time, as they count our engine's pre-step wait;
- one fresh directory per save, written by DCP's ``FileSystemWriter`` (files fsynced before the save completes,
  as ours are), and the default save planner with plan caching on (Lightning's proposal turns it on: a repeated
  save of the same structure reuses its plan).

DCP starts its process at the first save (in the background: that save's upload waits for it, seconds: a fresh
interpreter imports torch and the main module) and keeps it for the life of the training process, as our engine
keeps its helpers' fork server. The benchmarks run many fits in one process, so both outlive a fit: each starts in
the untimed warm-up, and no timed fit pays it (a training run pays it once). ``close()`` ends a run's part: the
groups made here and the stager's buffers, after a one-element save that makes DCP's process let go of the last
staged copy (it holds each request until the next arrives, which would keep a fit's buffers mapped into the next
fit); ``end_checkpoint_process`` ends the process itself, at the benchmark's end (DCP has no public call for
that). The process is a child of the training process, so ``common.cpu_seconds`` counts its CPU time, live or
ended and reaped. It is started with the ``spawn`` method: it imports the training script's main module again
(``__mp_main__``), so a script without a ``if __name__ == "__main__":`` guard runs its training again in it and
fails; the benchmarks are run as ``python -m benchmarks.bench_lightning`` and have the guard. DCP's process logs
each save at INFO on stderr (``[0] ... Received async checkpoint request``): torch sets that up in it.

    .venv/bin/python -m benchmarks.dcp_recipe   # a self-check: two runs' saves, each run's last loaded back
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from benchmarks.common import tensors_in

# the benchmarks' variants: their --variants keys, and their names in the reports
DCP_ASYNC, DCP_SYNC = (
    "DCP async_save, process, persistent DefaultStager, async staging",
    "DCP async_save, process, persistent DefaultStager, sync staging",
)
DCP_KEYS = {"dcp-process": DCP_ASYNC, "dcp-process-sync": DCP_SYNC}


class DcpProcessSaver:
    """One training run's DCP saves (see the module's docstring for the recipe and why each part).

    ``async_staging``: the stager copies in a thread (torchtitan's setting) or within ``save()``.
    Counters, for the benchmarks: ``saves``; ``staging_wait_s``, what ``wait_for_staging`` has made updates wait;
    ``upload_wait_s``, what ``save()`` has waited for the previous save's upload.
    """

    def __init__(self, *, async_staging: bool = True, plan_caching: bool = True) -> None:
        self.async_staging = async_staging
        self.planner = dcp.DefaultSavePlanner(enable_plan_caching=plan_caching)
        self.saves = 0
        self.staging_wait_s = 0.0
        self.upload_wait_s = 0.0
        self._group: dist.ProcessGroup | None = None
        self._owns_default_group = False
        self._stager: DefaultStager | None = None
        self._staging: Future[None] | None = None
        self._upload: Future[Any] | None = None

    def _start(self, state: Mapping[str, Any]) -> None:
        """At the first save: the process groups and the stager (whose CUDA stream must be made on this thread)."""
        if not dist.is_initialized():
            # a one-rank group in this process alone; DCP's process makes its own from the port found through it
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._owns_default_group = True
        self._group = dist.new_group(backend="gloo")
        cuda = any(t.is_cuda for t in tensors_in(state))
        options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=True,
            use_async_staging=self.async_staging,
            use_non_blocking_copy=cuda,
        )
        self._stager = DefaultStager(options)

    def save(self, state: Mapping[str, Any], directory: str | Path) -> None:
        """Start saving ``state`` (tensors and any other values: DCP writes those as pickled bytes) to
        ``directory``; returns once the copy is staged, or, with asynchronous staging, once it is started."""
        self.wait()  # the previous save's upload (and its staging, if no update waited for it)
        if self._stager is None:
            self._start(state)
        response = dcp.async_save(
            dict(state),
            storage_writer=dcp.FileSystemWriter(str(directory)),
            planner=self.planner,
            process_group=self._group,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self._stager,
        )
        if isinstance(response, AsyncSaveResponse):  # asynchronous staging
            self._staging, self._upload = response.staging_completion, response.upload_completion
        else:
            self._upload = response
        self.saves += 1

    def wait_for_staging(self) -> None:
        """Wait until the last save's copy is staged: call it before an update changes the tensors it copies."""
        if self._staging is None:
            return
        start = time.perf_counter()
        self._staging.result()
        self.staging_wait_s += time.perf_counter() - start
        self._staging = None

    def wait(self) -> None:
        """Wait until the last save is complete (written and fsynced); raises its error if it failed."""
        self.wait_for_staging()
        if self._upload is None:
            return
        start = time.perf_counter()
        self._upload.result()
        self.upload_wait_s += time.perf_counter() - start
        self._upload = None

    def close(self) -> None:
        """Wait for the last save, then free the staging buffers and the groups made here (DCP's process stays)."""
        try:
            self.wait()
            if self._group is not None:
                self._release_last_request()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
            if self._owns_default_group:
                dist.destroy_process_group()
                self._owns_default_group = False

    def _release_last_request(self) -> None:
        """A one-element save to a throwaway folder: DCP's process drops the last save's staged copy (mapped from
        this process's shared memory) only when another request arrives."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dcp-release-") as folder:
            response = dcp.async_save(
                {"release": torch.zeros(1)},
                checkpoint_id=folder,
                process_group=self._group,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            assert isinstance(response, Future)  # staged within the call (the default stager): a plain future
            response.result()


def end_checkpoint_process() -> None:
    """End the process DCP's process mode started, if any, and reap it.

    DCP keeps it in a module global for the life of the training process and ends it only when that object is
    collected (a terminate request, then SIGTERM after 5 s); there is no public call. The next save starts a new
    one.
    """
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is None:
        return
    executor._CHECKPOINT_PROCESS = None
    process.__del__()  # DCP's own shutdown: the terminate request, then SIGTERM if it is still alive after 5 s
    process._save_process.join(timeout=10)  # reaped: its CPU time moves into this process's RUSAGE_CHILDREN


def zeroed_like(tree: Any) -> Any:
    """``tree`` with a zeroed tensor in place of each tensor: a target for an in-place ``dcp.load``."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, Mapping):
        return {key: zeroed_like(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [zeroed_like(value) for value in tree]
    return tree


def _checkpoint_process() -> Any:
    """DCP's process (psutil), which must be running."""
    import psutil
    from torch.distributed.checkpoint import _async_process_executor as executor

    assert executor._CHECKPOINT_PROCESS is not None, "DCP's process is not running"
    return psutil.Process(executor._CHECKPOINT_PROCESS._save_process.pid)


def _train_and_save(saver: DcpProcessSaver, model: Any, optimizer: Any, root: Path, steps: range) -> dict[str, Any]:
    """An update then a save (``step-N``), for each step; returns what the last save saved (live tensors)."""
    from benchmarks.common import model_state

    batch = torch.randn(8, model[0].in_features)
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        saver.wait_for_staging()  # as a training loop does before each update
        optimizer.step()
        saver.save({**model_state(model, optimizer), "step": step}, root / f"step-{step}")
    saver.wait()
    return {**model_state(model, optimizer), "step": steps[-1]}


def _loads_back_equal(expected: dict[str, Any], directory: Path) -> None:
    """``dcp.load`` of ``directory`` into fresh tensors of ``expected``'s structure gives ``expected``."""
    target = zeroed_like(expected) | {"step": 0}
    for group in target["optim"]["param_groups"]:
        group["lr"] = -1.0  # a non-tensor value the load must put back
    dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    assert target["step"] == expected["step"], (target["step"], expected["step"])
    assert target["optim"]["param_groups"] == expected["optim"]["param_groups"]
    for want, got in zip(tensors_in(expected), tensors_in(target), strict=True):
        assert torch.equal(want, got)


def _self_check() -> None:
    """Two runs, as the benchmarks make them in one process: three saves of a small model and Adam, each after
    an update, then a new saver's one save; each run's last checkpoint loaded back with ``dcp.load`` into fresh
    tensors and compared. DCP's process serves both runs and is counted by ``common.cpu_seconds``, then ends."""
    import tempfile

    import psutil

    from benchmarks.common import build, cpu_seconds

    torch.manual_seed(0)
    model, optimizer, size = build(layers=2, width=256)
    with tempfile.TemporaryDirectory(prefix="dcp-recipe-") as folder:
        root = Path(folder)
        cpu_before = cpu_seconds()
        saver = DcpProcessSaver()
        expected = _train_and_save(saver, model, optimizer, root, range(1, 4))
        child = _checkpoint_process()
        child_cpu, counted = sum(child.cpu_times()[:2]), cpu_seconds() - cpu_before
        saver.close()
        _loads_back_equal(expected, root / "step-3")
        second = DcpProcessSaver(async_staging=False)  # a later run: new groups and stager, the same process
        _loads_back_equal(_train_and_save(second, model, optimizer, root, range(4, 5)), root / "step-4")
        assert _checkpoint_process().pid == child.pid, "a second run started another DCP process"
        second.close()
    end_checkpoint_process()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, "DCP's process outlived its end"
    assert counted >= child_cpu, (counted, child_cpu)
    print(
        f"dcp_recipe self-check passed: two runs (3 saves with async staging, 1 with sync staging) of "
        f"{size / 1e6:.1f} MB through one DCP process, each run's last save loaded back equal (model, Adam moments "
        f"and steps, param groups, a non-tensor value); DCP's process used {child_cpu:.2f} s of CPU over the first "
        f"run (its start included), of the {counted:.2f} s common.cpu_seconds counted; the first run's staging "
        f"waits {saver.staging_wait_s:.4f} s, upload waits {saver.upload_wait_s:.3f} s (DCP's process starting)."
    )


if __name__ == "__main__":
    _self_check()
