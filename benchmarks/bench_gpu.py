"""GPU check (item 9): pinned staging bandwidth, async staging during real GPU training, real NVML readings.

Run through ``benchmarks/gpu_check.sh`` on a machine with one CUDA GPU and a CUDA build of torch; sized to
finish well within 8 minutes on an H200.

1. Device-to-host copies of the same GPU tensors (--bandwidth-gb, fp32): ``tensor.cpu()`` into fresh pageable
   memory, ``copy_`` into preallocated pageable buffers, and the engine's ``HostStager`` into the pinned buffers
   it allocates once and reuses (synchronous, and asynchronous: time until the call returns and until the copy
   is done).
2. The engine benchmark's turns (``bench_engine``) with the model on the GPU (8 x Linear(w, w) + Adam, batch
   --batch): save, one training step, wait for the save. On a GPU the asynchronous copy's wait is a wait of the
   CUDA stream, not of the host, so blocking = the save call + how much longer the step after it took than a
   step without a save (its median in this run).
3. NVML: what this GPU answers through nvidia-ml-py; the HealthGuard's monitor started against the real driver
   (running or not, and what it reported); its overhead on real training steps (back-to-back pairs with and
   without it); and an XID 79 injected on top of the real readings (pass-through), stopping training at a step
   and saving the GPU state as an emergency checkpoint, timed from the fault to the local commit.

    benchmarks/gpu_check.sh            (or: .venv/bin/python -m benchmarks.bench_gpu [--quick])
"""

from __future__ import annotations

import logging
import signal
import sys
import time
import traceback
from typing import Any

import torch

from benchmarks.bench_engine import FLOOR, VARIANTS, Variant, take_turns
from benchmarks.common import (
    GB,
    LAYERS,
    Report,
    Stats,
    Stepper,
    build,
    column,
    model_state,
    now,
    parse,
    parser,
    ratio,
    scratch,
    verdict,
    width_for,
)
from resilience import CheckpointConfig, CheckpointManager
from resilience.checkpoint.staging import HostStager
from resilience.health import FaultEvent, HealthConfig, HealthGuard
from resilience.health.nvml import default_devices, load_nvml

NO_SAVE = "no save (step time reference)"
RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, for nvidia-ml-py versions that lack the name


class NoSave(Variant):
    """A turn without a save: the step time the other turns are compared with."""

    def save(self, step: int) -> None:
        self.done = now()


def synced(fn: Any) -> float:
    """Seconds until ``fn`` and all GPU work it queued are done."""
    torch.cuda.synchronize()
    start = now()
    fn()
    torch.cuda.synchronize()
    return now() - start


def bandwidth(size_gb: float, report: Report) -> None:
    tensors = [torch.randn(int(size_gb * GB / 4 / 16), device="cuda") for _ in range(16)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pageable = [torch.empty_like(t, device="cpu") for t in tensors]
    stager = HostStager(pin_memory=True)
    named = {f"t{i}": t for i, t in enumerate(tensors)}
    stager.stage(named)  # allocates the pinned buffers once, as the first save does

    def copy_into() -> None:
        for buffer, tensor in zip(pageable, tensors, strict=True):
            buffer.copy_(tensor)

    def staged_async() -> float:
        """Seconds until stage() returns; the copy goes on."""
        start = now()
        job = stager.stage(named, asynchronous=True)
        returned = now() - start
        job.wait()
        return returned

    ways = {
        "tensor.cpu() (fresh pageable memory)": lambda: [t.cpu() for t in tensors],
        "copy_ into preallocated pageable buffers": copy_into,
        "HostStager, pinned reused buffers, synchronous": lambda: stager.stage(named),
        "HostStager, pinned reused buffers, asynchronous (until done)": lambda: stager.stage(
            named, asynchronous=True
        ).wait(),
    }
    seconds = {name: [synced(fn) for _ in range(5)] for name, fn in ways.items()}
    returns = [staged_async() for _ in range(5)]
    stager.close()
    plain = Stats.of(seconds["tensor.cpu() (fresh pageable memory)"]).median
    report.heading(f"Device-to-host copies of {nbytes / GB:.2f} GB (16 fp32 tensors; 5 repeats)")
    report.table(
        ["copy", "seconds", "GB/s", "x tensor.cpu()"],
        [
            [
                name,
                Stats.of(v).fmt(4),
                f"{nbytes / GB / Stats.of(v).median:.1f}",
                f"{ratio(plain, Stats.of(v).median):.1f}",
            ]
            for name, v in seconds.items()
        ],
    )
    report.add(
        f"- Asynchronous staging returns after {Stats.of(returns).fmt(5)} s while the copy runs on a side stream."
    )


def engine_turns(args: Any, root: Any, report: Report) -> None:
    width = width_for(args.size_gb)
    model, optimizer, size = build(LAYERS, width, device="cuda")
    stepper = Stepper(model, optimizer, width, batch=args.batch)
    stepper.step()

    def state() -> dict[str, Any]:
        return model_state(model, optimizer)

    variants: dict[str, Variant] = {NO_SAVE: NoSave(), **{name: make(state, root) for name, make in VARIANTS.items()}}
    samples = take_turns(variants, stepper, args.repeats)
    plain_step = column(samples[NO_SAVE], "step").median
    for rows in samples.values():
        for row in rows:
            row["gpu_block"] = row["save"] + max(0.0, row["step"] - plain_step)
    floor = column(samples[FLOOR], "gpu_block").median
    report.heading(
        f"Blocking per save during GPU training: {LAYERS} x Linear({width}, {width}) + Adam = {size / GB:.2f} GB "
        f"on the GPU, batch {args.batch}; {args.repeats} rounds after a warm-up"
    )
    report.table(
        [
            "variant",
            "save call",
            "step after the save",
            "blocking (call + extra step time)",
            "x floor",
            "time to commit",
        ],
        [
            [
                name,
                column(rows, "save").fmt(4),
                column(rows, "step").fmt(4),
                column(rows, "gpu_block").fmt(4),
                f"{ratio(column(rows, 'gpu_block').median, floor):.2f}",
                column(rows, "commit").fmt(3),
            ]
            for name, rows in samples.items()
        ],
    )
    for name, target in (("ours, sync staging", 1.5), ("ours, async staging", 0.2)):
        share = ratio(column(samples[name], "gpu_block").median, floor)
        report.add(
            f"- Issue 2 target on a GPU, {name}: at most {target}x the floor: {share:.2f}x, {verdict(share <= target)}."
        )


def nvml_readings(report: Report) -> None:
    nvml = load_nvml()
    if nvml is None:
        report.add("- nvidia-ml-py is not installed: no NVML readings (pip install nvidia-ml-py).")
        return
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        report.add(f"- NVML is not available ({type(exc).__name__}: {exc}).")
        return
    device = default_devices()[0]
    handle = (
        nvml.nvmlDeviceGetHandleByIndex(device) if isinstance(device, int) else nvml.nvmlDeviceGetHandleByUUID(device)
    )
    field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", RECOVERY_ACTION_FIELD)
    reads = {
        "name": lambda: nvml.nvmlDeviceGetName(handle),
        "driver": nvml.nvmlSystemGetDriverVersion,
        "temperature, C": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        "power, W": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
        "utilization gpu / memory, %": lambda: (lambda u: f"{u.gpu} / {u.memory}")(
            nvml.nvmlDeviceGetUtilizationRates(handle)
        ),
        "uncorrected ECC errors (volatile)": lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        ),
        "remapped rows (corrected, uncorrected, pending, failure)": lambda: nvml.nvmlDeviceGetRemappedRows(handle),
        "clock event reasons": lambda: hex(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
        "recovery action field (return code, value)": lambda: (lambda v: (v.nvmlReturn, v.value.uiVal))(
            nvml.nvmlDeviceGetFieldValues(handle, [field])[0]
        ),
    }
    rows = []
    for label, read in reads.items():
        try:
            rows.append([label, read()])
        except nvml.NVMLError as exc:
            rows.append([label, f"not answered: {type(exc).__name__}"])
    nvml.nvmlShutdown()
    report.heading(f"NVML readings of GPU {device}")
    report.table(["query", "answer"], rows)


def monitor(args: Any, root: Any, report: Report) -> None:
    """The guard against the real driver: running or not, its cost on real steps, and a fault drill."""
    width = width_for(args.size_gb)
    model, optimizer, size = build(LAYERS, width, device="cuda")
    stepper = Stepper(model, optimizer, width, batch=args.batch)
    seen: list[FaultEvent] = []

    def run(count: int, guard: HealthGuard | None) -> float:
        start = now()
        for step in range(count):
            stepper.step()
            if guard is not None:
                guard.on_step(step)
        return (now() - start) / count

    plain: list[float] = []
    added: list[float] = []
    running = False
    for _ in range(args.pairs + 1):  # the first pair warms up
        base = run(args.steps, None)
        with HealthGuard(HealthConfig(), listeners=[seen.append]) as guard:
            running = guard.monitor is not None and guard.monitor.running
            added.append(run(args.steps, guard) - base)
        plain.append(base)
    step_s, extra = Stats.of(plain[1:]), Stats.of(added[1:])
    report.heading("Health monitor against the real driver")
    report.add(
        f"- Monitor thread running on real NVML: {running}. Events it reported during {args.pairs + 1} runs of "
        f"{args.steps} steps: {[e.detail for e in seen] or 'none'}."
    )
    share = extra.median / step_s.median
    report.add(
        f"- Step {step_s.fmt(4)} s without the guard; added with it {extra.fmt(5)} s per step "
        f"({100 * share:+.3f}%): target < 1% {verdict(share < 0.01)}."
    )
    with CheckpointManager(CheckpointConfig(local_root=root / "emergency")) as manager:
        fault_step = 5
        with HealthGuard(HealthConfig(inject=f"xid=79@step={fault_step}")) as guard:
            stepper.step()
            decision = guard.on_step(fault_step)
            result = guard.emergency_save(manager, fault_step, model_state(model, optimizer)) if decision.stop else None
    if result is None:
        report.add(f"- Injected XID 79 did not stop training: {decision}.")
    else:
        report.add(
            f"- Injected XID 79 (pass-through over the real readings): stop={decision.stop}; emergency save of "
            f"{size / GB:.2f} GB from the GPU committed locally: {result.local_committed}, "
            f"{result.fault_to_local_s or float('nan'):.2f} s after the fault."
        )


def main() -> None:
    p = parser(__doc__, size_gb=1.6, repeats=3)
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    p.add_argument("--bandwidth-gb", type=float, default=4.0)
    p.add_argument("--batch", type=int, default=4096, help="rows per training batch (default %(default)s)")
    p.add_argument("--pairs", type=int, default=10, help="monitor overhead: pairs of runs (default %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="monitor overhead: steps per run (default %(default)s)")
    args = parse(p)
    if not torch.cuda.is_available():
        raise SystemExit(
            f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); nothing to check"
        )
    if args.quick:
        args.size_gb, args.bandwidth_gb, args.repeats, args.pairs, args.steps = 0.2, 0.5, 1, 3, 10
    logging.getLogger("resilience.health").setLevel(logging.ERROR)  # the drill's fault and stop are expected
    started = time.monotonic()
    report = Report(
        "GPU check (item 9)",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}); state about "
        f"{args.size_gb} GB, batch {args.batch}",
    )
    # gpu_check.sh's time limit sends SIGTERM first: print what was measured up to then.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit("gpu_check: stopped at its time limit"))
    try:
        with scratch(args.dir, "gpu") as root:
            parts = {
                "device-to-host copies": lambda: bandwidth(args.bandwidth_gb, report),
                "blocking per save": lambda: engine_turns(args, root, report),
                "NVML readings": lambda: nvml_readings(report),
                "health monitor": lambda: monitor(args, root, report),
            }
            for name, part in parts.items():
                # Nothing of this has run on a GPU before: one part failing must not hide what the others measure.
                try:
                    part()
                except Exception as exc:  # reported, with its traceback on stderr
                    traceback.print_exc()
                    report.add(f"\n- {name}: failed with {type(exc).__name__}: {exc}")
                torch.cuda.empty_cache()  # each part builds its own tensors
                print(f"gpu_check: {name} done at {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        report.add(f"\n_{time.monotonic() - started:.0f} s for the whole check._")
        report.print()


if __name__ == "__main__":
    main()
