"""Copying state to host memory into buffers that are allocated once and reused.

The copy into host memory is the only part of a save the training loop has to wait for. Reusing the
buffers keeps host memory flat across saves and avoids the page faults of fresh allocations, which cost
several times the copy itself; pinning them (for CUDA sources) lets the copy run as a DMA on a side stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _NormBase

from resilience.checkpoint.shm import create_segment, map_segment, release_segment
from resilience.config import CheckpointConfig

log = logging.getLogger(__name__)


def barrier_for(config: CheckpointConfig, modules: Iterable[torch.nn.Module]) -> CheckpointConfig:
    """Resolve ``staging_barrier="auto"``: a forward that updates saved buffers (BatchNorm running statistics)
    must wait for an asynchronous copy too, not only the next optimizer step."""
    if config.staging_barrier != "auto":
        return config
    updates = any(isinstance(m, _NormBase) and m.track_running_stats for module in modules for m in module.modules())
    return dataclasses.replace(config, staging_barrier="forward" if updates else "optimizer_step")


class StagingJob:
    """One state's copy to host memory, possibly still running.

    The training thread calls :meth:`release_source` before it changes the state again; the writer calls
    :meth:`wait` before it reads the staged copy.
    """

    def __init__(
        self,
        staged: dict[str, torch.Tensor],
        cuda_event: torch.cuda.Event | None = None,
        cpu_copy: Future[None] | None = None,
    ):
        self.staged = staged
        self._cuda_event = cuda_event
        self._cpu_copy = cpu_copy

    def release_source(self) -> None:
        """Order later changes of the source after the copy; on CUDA this waits on the device, not the host."""
        if self._cuda_event is not None and torch.cuda.is_available():
            torch.cuda.current_stream().wait_event(self._cuda_event)
        if self._cpu_copy is not None:
            self._cpu_copy.result()

    def wait(self) -> dict[str, torch.Tensor]:
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        if self._cpu_copy is not None:
            self._cpu_copy.result()
        return self.staged

    @property
    def nbytes(self) -> int:
        """Bytes staged on this rank (a DTensor's local shard, not its global size)."""
        return local_nbytes(self.staged.values())

    @property
    def done(self) -> bool:
        cuda_done = self._cuda_event is None or self._cuda_event.query()
        return cuda_done and (self._cpu_copy is None or self._cpu_copy.done())


def local_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` on this rank: a DTensor's local shard, not its global size (in the helper, a Piece's)."""
    local = [t._local_tensor if isinstance(t, DTensor) else getattr(t, "local", t) for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


class HostStager:
    """Keeps one host buffer per checkpoint key and copies tensors into it.

    Args:
        pin_memory: Page-lock buffers of CUDA sources (default: yes when CUDA is available).
        shared: Put the buffers in shared memory, so the helper process that writes them reads them in place.
    """

    def __init__(self, pin_memory: bool | None = None, *, shared: bool = False):
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._shared = shared
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def count(self) -> int:
        """Buffers held: one per key, each its own shared-memory segment where they are shared."""
        return len(self._buffers)

    def stage(self, tensors: Mapping[str, torch.Tensor], *, asynchronous: bool = False) -> StagingJob:
        """Copy ``tensors`` into the buffers; with ``asynchronous`` return before the copy has finished."""
        staged: dict[str, torch.Tensor] = {}
        cuda_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        cpu_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        with self._lock:
            for key, tensor in tensors.items():
                local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
                _check_device(key, local)
                buffer = self._buffer(key, local.shape, local.dtype, cuda=local.is_cuda)
                (cuda_pairs if local.is_cuda else cpu_pairs).append((buffer, local))
                staged[key] = (
                    DTensor(buffer, tensor._spec, requires_grad=False) if isinstance(tensor, DTensor) else buffer
                )
        event = self._copy_cuda(cuda_pairs, asynchronous) if cuda_pairs else None
        cpu_copy: Future[None] | None = None
        if cpu_pairs and asynchronous:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="resilience-stage")
            cpu_copy = self._pool.submit(_copy_all, cpu_pairs)
        elif cpu_pairs:
            _copy_all(cpu_pairs)
        if event is not None and not asynchronous:
            event.synchronize()
            event = None
        return StagingJob(staged, event, cpu_copy)

    def _buffer(self, key: str, shape: Sequence[int], dtype: torch.dtype, *, cuda: bool) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tuple(shape) or buffer.dtype != dtype:
            if buffer is not None:
                _release(buffer)
            pin = self._pin and cuda
            if self._shared:
                buffer = _shared_buffer(shape, dtype, pin=pin)
            else:
                buffer = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
        return buffer

    def _copy_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], asynchronous: bool) -> torch.cuda.Event:
        current = torch.cuda.current_stream()
        stream = current
        if asynchronous:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            stream = self._stream
            stream.wait_stream(current)  # copy the values as of now, not as of later kernels
        with torch.cuda.stream(stream), torch.no_grad():
            for buffer, source in pairs:
                buffer.copy_(source, non_blocking=True)
                if asynchronous:
                    source.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for buffer in self._buffers.values():
            _release(buffer)
        self._buffers.clear()


class Loan:
    """One save's staged tensors, lent to a reader until it gives them back; the next save waits for that.

    A name's writer (a Lightning ``.ckpt`` made from a committed step) reads the tensors of the step it names
    from here rather than from the files just written: those were written past the page cache, and on a disk
    whose reads and writes share one bandwidth, reading a step back costs more than writing it. The buffers
    hold exactly the bytes the step's files were written (and hashed) from, until the next save copies into
    them, which is why that save waits for every loan of them to come back.

    Args:
        tensors: The save's staged tensors on this rank, by DCP key (a DTensor's buffer holds its local shard, not
            the tensor).
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.returned: Future[None] = Future()

    def give_back(self) -> None:
        """The reader is done with the buffers (idempotent)."""
        with contextlib.suppress(InvalidStateError):
            self.returned.set_result(None)

    def by_segment(self) -> SharedTensors | None:
        """The same tensors for another process, by shared-memory segment; None where a buffer has none."""
        refs = {key: segment_of(t) for key, t in self.tensors.items()}
        if any(ref[0] is None and math.prod(ref[2]) for ref in refs.values()):
            return None
        return SharedTensors(refs)


SegmentRef = tuple[str | None, str, tuple[int, ...]]  # segment name (None: empty tensor), dtype name, shape


class SharedTensors(Mapping[str, torch.Tensor]):
    """Staging buffers named by their shared-memory segments: pickled, they go to another process, which maps
    each segment once, on first use, and reads the buffers in place (nothing is copied)."""

    def __init__(self, refs: dict[str, SegmentRef]):
        self.refs = refs
        self._mapped: dict[str, torch.Tensor] = {}

    def __getstate__(self) -> dict[str, SegmentRef]:
        return self.refs

    def __setstate__(self, refs: dict[str, SegmentRef]) -> None:
        self.__init__(refs)  # type: ignore[misc]

    def __getitem__(self, key: str) -> torch.Tensor:
        return attach(self.refs[key], self._mapped)

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def __len__(self) -> int:
        return len(self.refs)


# Named shared-memory segments behind staging buffers, by the buffer's data pointer: a helper process maps them
# by name. They live as long as their buffers (the stager unlinks them when it drops a buffer).
SEGMENTS: dict[int, str] = {}
# Page-locked (cudaHostRegister) segment mappings by data pointer, each held here until it is unregistered:
# registered memory must be unregistered before it is unmapped. Without that (on an H200, once a fit's buffers
# had been freed while registered), a later fit in the same process failed with "resource already mapped".
PINNED: dict[int, torch.Tensor] = {}


def segment_of(tensor: torch.Tensor) -> SegmentRef:
    """How another process finds a staging buffer: its segment's name (None: empty, or not shared), dtype, shape."""
    name = SEGMENTS.get(tensor.data_ptr()) if tensor.numel() else None
    return name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)


def attach(ref: SegmentRef, mapped: dict[str, torch.Tensor]) -> torch.Tensor:
    """The staging buffer ``ref`` names, mapped in this process (each segment once, cached in ``mapped``)."""
    name, dtype_name, shape = ref
    dtype = getattr(torch, dtype_name)
    if name is None:
        return torch.empty(shape, dtype=dtype)
    flat = mapped.get(name)
    if flat is None:
        flat = mapped[name] = map_segment(name)
    return flat[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def _shared_buffer(shape: Sequence[int], dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A host buffer in a named shared-memory segment (``/dev/shm``), page-locked for CUDA sources."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    try:
        name, flat = create_segment(nbytes)
    except (OSError, RuntimeError) as exc:
        raise RuntimeError(
            f"cannot place {nbytes} bytes of checkpoint staging in shared memory ({exc}): enlarge /dev/shm "
            "(e.g. docker --shm-size) or set persist='thread'"
        ) from exc
    buffer = flat.view(dtype).view(tuple(shape))
    SEGMENTS[buffer.data_ptr()] = name
    if pin and buffer.numel():
        error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(error) != 0:
            _release(buffer)  # not registered: only its segment goes
            raise RuntimeError(
                f"cudaHostRegister refused to page-lock a staging buffer ({error}): set pin_memory=False"
            )
        PINNED[buffer.data_ptr()] = flat
    return buffer


def _release(buffer: torch.Tensor) -> None:
    """Unregister a page-locked buffer (once no copy into it can be running) and unlink its shared-memory segment,
    if it has one (mappings elsewhere stay valid until they are dropped)."""
    pointer = buffer.data_ptr()
    if pointer in PINNED:
        torch.cuda.synchronize()  # an asynchronous copy into it may still run; releases are rare (close, reshape)
        error = torch.cuda.cudart().cudaHostUnregister(pointer)
        if int(error) != 0:  # kept mapped, as registered: unmapping it would leave the driver's record stale
            log.warning("cudaHostUnregister of a staging buffer failed (%s); its memory stays mapped", error)
        else:
            del PINNED[pointer]
    name = SEGMENTS.pop(pointer, None)
    if name is not None:
        release_segment(name)


def _check_device(key: str, tensor: torch.Tensor) -> None:
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot stage {key!r} from device {tensor.device}: move it to CPU or CUDA")


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, source in pairs:
            buffer.copy_(source)
