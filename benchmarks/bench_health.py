"""Health: from a GPU fault to a committed emergency checkpoint, and what watching costs a step (issue 5).

Fault to commit: a ``HealthGuard`` with default settings watches NVML (no driver here, so the engine's simulated
GPU answers; the monitor code is the same) and gets an XID 79 (GPU fallen off the bus) injected at a step. At
that step boundary the guard decides to stop and ``emergency_save`` saves the state (8 x Linear(w, w) + Adam,
w from --size-gb) through a CheckpointManager with default settings (synchronous staging, fsync). Time = from the
fault event to the local commit, as the guard measures it; one fresh guard per repeat.

Overhead: the same training loop (a smaller model, --overhead-size-gb) with and without a started guard (NVML
monitor and hang-watchdog threads running, ``on_step`` at every step), in back-to-back pairs so both halves of a
pair see the same machine; reported as the median paired difference per step with its IQR. ``on_step`` is also
timed alone in a tight loop, and set against the full-size model's step.

    .venv/bin/python -m benchmarks.bench_health [--size-gb 1.6] [--repeats 3] [--pairs 15] [--dir DIR]
"""

from __future__ import annotations

import logging
import time

from benchmarks.common import (
    LAYERS,
    Report,
    Stats,
    Stepper,
    build,
    model_state,
    now,
    parse,
    parser,
    scratch,
    verdict,
    width_for,
)
from resilience import CheckpointConfig, CheckpointManager
from resilience.health import HealthConfig, HealthGuard, SimulatedNVML
from resilience.health.nvml import load_nvml

TIGHT_LOOP = 2000


def watching() -> HealthGuard:
    """A guard with its NVML monitor running: against a simulated GPU, as no driver is here to answer."""
    return HealthGuard(HealthConfig(), nvml=SimulatedNVML(load_nvml()))


def steps(stepper: Stepper, count: int, guard: HealthGuard | None) -> tuple[float, float]:
    """Wall and process-CPU seconds per step over ``count`` steps."""
    wall, cpu = now(), time.process_time()
    for step in range(count):
        stepper.step()
        if guard is not None:
            guard.on_step(step)
    return (now() - wall) / count, (time.process_time() - cpu) / count


def overhead(stepper: Stepper, pairs: int, count: int) -> tuple[Stats, Stats, Stats, Stats]:
    """Plain seconds per step (wall, CPU) and the guard's added seconds per step (wall, CPU)."""
    plain: list[tuple[float, float]] = []
    added: list[tuple[float, float]] = []
    for _ in range(pairs + 1):  # the first pair warms up
        base = steps(stepper, count, None)
        with watching() as guard:  # started (threads running) before the clock starts
            guarded = steps(stepper, count, guard)
        plain.append(base)
        added.append((guarded[0] - base[0], guarded[1] - base[1]))
    return (
        Stats.of(p[0] for p in plain[1:]),
        Stats.of(p[1] for p in plain[1:]),
        Stats.of(a[0] for a in added[1:]),
        Stats.of(a[1] for a in added[1:]),
    )


def on_step_cost() -> float:
    with watching() as guard:
        start = now()
        for step in range(TIGHT_LOOP):
            guard.on_step(step)
        return (now() - start) / TIGHT_LOOP


def within_target(q1: float, q3: float, target: float = 1.0) -> str:
    """A verdict from an interquartile range: decided only when the whole range is on one side of the target."""
    if q3 < target:
        return verdict(True)
    if q1 >= target:
        return verdict(False)
    return "**inconclusive** (the IQR spans the target: the machine's noise is larger than the effect)"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--pairs", type=int, default=15, help="overhead: timed pairs of runs (default %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="overhead: steps per run (default %(default)s)")
    p.add_argument("--overhead-size-gb", type=float, default=0.1, help="overhead: model size (default %(default)s)")
    args = parse(p)
    logging.getLogger("resilience.health").setLevel(logging.ERROR)  # the drill's fault and stop are expected
    width = width_for(args.size_gb)
    model, optimizer, size = build(LAYERS, width)
    stepper = Stepper(model, optimizer, width)
    report = Report(
        "Health: fault to committed emergency checkpoint, and monitor overhead (issue 5)",
        f"{LAYERS} x Linear({width}, {width}) + Adam = {size / 1e9:.2f} GB for the emergency save, default "
        f"HealthConfig and CheckpointConfig; {args.repeats} injected faults; overhead: "
        f"{args.pairs} pairs of {args.steps}-step runs on a {args.overhead_size_gb} GB model",
    )
    fault_to_commit, full_step = [], []
    with scratch(args.dir, "health") as root, CheckpointManager(CheckpointConfig(local_root=root)) as manager:
        for repeat in range(args.repeats):
            step = 10 * (repeat + 1)
            with HealthGuard(HealthConfig(inject=f"xid=79@step={step}")) as guard:
                full_step.append(steps(stepper, 1, None)[0])
                decision = guard.on_step(step)
                if not decision.stop:
                    raise RuntimeError(f"the injected XID 79 did not stop training at step {step}: {decision}")
                result = guard.emergency_save(manager, step, model_state(model, optimizer))
            if not result.local_committed or result.fault_to_local_s is None:
                raise RuntimeError(f"the emergency save of step {step} was not committed: {result}")
            fault_to_commit.append(result.fault_to_local_s)
    del model, optimizer, stepper

    small_width = width_for(args.overhead_size_gb)
    small_model, small_optimizer, _ = build(LAYERS, small_width)
    plain_wall, plain_cpu, added_wall, added_cpu = overhead(
        Stepper(small_model, small_optimizer, small_width), args.pairs, args.steps
    )
    cost = on_step_cost()
    grace = HealthConfig().grace_s
    committed = Stats.of(fault_to_commit)
    report.table(
        ["measure", "median [IQR]"],
        [
            ["fault -> emergency checkpoint committed locally, s", committed.fmt(2)],
            [f"full-size training step ({size / 1e9:.2f} GB), s", Stats.of(full_step).fmt(3)],
            [
                f"small training step ({args.overhead_size_gb} GB), wall / CPU ms",
                f"{plain_wall.fmt(2, 1e3)} / {plain_cpu.fmt(2, 1e3)}",
            ],
            ["added by the guard per small step, wall ms", added_wall.fmt(3, 1e3)],
            ["added by the guard per small step, CPU ms", added_cpu.fmt(3, 1e3)],
            [f"on_step alone ({TIGHT_LOOP} calls), µs", f"{cost * 1e6:.1f}"],
        ],
    )
    report.add(
        f"- Fault to committed emergency checkpoint: {committed.median:.2f} s, within the default grace of "
        f"{grace:.0f} s: {verdict(committed.q3 <= grace)}."
    )
    paired = [100 * v / plain_wall.median for v in (added_wall.median, added_wall.q1, added_wall.q3)]
    cpu_share = 100 * added_cpu.median / plain_cpu.median
    direct = [100 * cost / plain_wall.median, 100 * cost / Stats.of(full_step).median]
    report.add(
        f"- Target: monitor overhead on step time < 1%. Paired wall time: {paired[0]:+.2f}% "
        f"[{paired[1]:+.2f}%, {paired[2]:+.2f}%] on the small step (CPU {cpu_share:+.2f}%): "
        f"{within_target(paired[1], paired[2])}. On the training thread, on_step alone is {direct[0]:.3f}% of "
        f"the small step and {direct[1]:.4f}% of the full-size step: {verdict(direct[0] < 1)}."
    )
    report.add(
        "- Without a GPU the monitor reads a simulated device that supports no query, so its thread does less "
        "than on a real GPU (there it polls ECC, remapped rows and clock reasons every 5 s): gpu_check.sh "
        "measures it against real NVML."
    )
    report.print()


if __name__ == "__main__":
    main()
