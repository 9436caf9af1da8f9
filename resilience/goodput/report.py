"""``resilience report RUN_DIR``: where a run's wall time went, as a table, JSON, or a timeline picture."""

from __future__ import annotations

import json
import sys
import time

from resilience.goodput.summary import LABELS, RECOVERY_PARTS, GoodputSummary, Incarnation, summarize
from resilience.progress import size_text

RECOVERY_HEADS = ("START-UP", "LIST", "VERIFY", "READ", "INTO MODEL", "FIRST STEP")  # RECOVERY_PARTS'


def duration(seconds: float) -> str:
    """Short human duration: 950ms, 42.1s, 12m 05s, 3h 02m."""
    if seconds < 1:
        return f"{1e3 * seconds:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def headline(summary: GoodputSummary) -> str:
    mtbf = summary.observed_mtbf_s
    return (
        f"Goodput {summary.goodput_pct:.1f}% of {duration(summary.wall_s)} wall time: "
        f"{len(summary.incarnations)} incarnation(s), {summary.failures} failure(s)"
        + (f", MTBF {duration(mtbf)}" if mtbf is not None else "")
    )


def _ended(inc: Incarnation, last: bool) -> str:
    if inc.end_reason is not None:
        return inc.end_reason
    return "running or killed" if last else "killed (no end record)"


def render_table(summary: GoodputSummary) -> str:
    lines = [headline(summary), ""]
    lines.append(f"{'BUCKET':<22} {'TIME':>10} {'% WALL':>7}")
    for name, seconds in summary.buckets.items():
        pct = 100.0 * seconds / summary.wall_s if summary.wall_s > 0 else 0.0
        lines.append(f"{LABELS[name]:<22} {duration(seconds):>10} {pct:>6.1f}%")
    lines.append(f"{'total':<22} {duration(summary.wall_s):>10} {100.0:>6.1f}%")
    lines += [
        "",
        f"{'#':>3}  {'STARTED':<19}  {'UP':>8}  {'DOWN BEFORE':>11}  {'RESUMED AT':>10}  "
        f"{'REDONE':>6}  {'REACHED':>7}  {'LOST':>8}  ENDED",
    ]
    for inc in summary.incarnations:
        if inc.restored_step is None or (inc.index == 0 and inc.restore_inferred):
            resumed = "-"
        else:
            resumed = f"{inc.restored_step}{'?' if inc.restore_inferred else ''}"
        lines.append(
            f"{inc.index:>3}  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(inc.start)):<19}  "
            f"{duration(inc.uptime_s):>8}  {duration(inc.downtime_before_s) if inc.index else '-':>11}  "
            f"{resumed:>10}  {inc.redone_steps if inc.index else '-':>6}  "
            f"{'-' if inc.last_step is None else inc.last_step:>7}  {duration(inc.lost_s):>8}  "
            f"{_ended(inc, inc is summary.incarnations[-1])}"
        )
    lines.append("")
    lines.append(
        "RESUMED AT: step restored ('?': inferred from the first step done); REDONE: steps done before that had "
        "to be done again; LOST: this incarnation's productive time thrown away by a later resume."
    )
    restarts = summary.incarnations[1:]
    if restarts:
        lines += ["", "Recovery per restart, from the previous incarnation's last record to the first step done:"]
        heads = "  ".join(f"{h:>10}" for h in RECOVERY_HEADS)
        lines.append(f"{'#':>3}  {'HOW':<8}  {'DOWN':>8}  {heads}  {'TOTAL':>8}  READ FROM")
        for inc in restarts:
            parts = "  ".join(f"{duration(inc.recovery.get(part, 0.0)):>10}" for part in RECOVERY_PARTS)
            lines.append(
                f"{inc.index:>3}  {inc.restart or '':<8}  {duration(inc.downtime_before_s):>8}  {parts}  "
                f"{duration(inc.recovery_s):>8}  {_read_from(inc.read_from)}"
            )
        lines.append(
            "HOW: in place (the same processes ran their script again, resilience launch), replaced (a new process "
            "of resilience launch), relaunch; DOWN: from the previous incarnation's last record to this one's start; "
            "START-UP: interpreter (if new), imports, model, process group; LIST, VERIFY, READ: finding the "
            "checkpoint, its checksums, reading it; INTO MODEL: the state put into the model; FIRST STEP: the first "
            "training step after it; READ FROM: where the main process's restore read its bytes (disk: this node's "
            "copy of a durable checkpoint; peers: other nodes' memory and disks)."
        )
    lines += _retry_lines(summary)
    lines += _stragglers(summary)
    if summary.skipped_lines:
        lines.append(
            f"{summary.skipped_lines} unreadable ledger line(s) skipped (a kill mid-write tears the last one)."
        )
    return "\n".join(lines)


def _read_from(places: dict[str, float]) -> str:
    """``peers 1.2 GiB, durable 0 B``: the bytes a restore read in each place, largest first."""
    return ", ".join(f"{place} {size_text(n)}" for place, n in sorted(places.items(), key=lambda pair: -pair[1])) or "-"


def _retry_lines(summary: GoodputSummary) -> list[str]:
    """Retried transfers to the durable tier per incarnation: a store that throttles slows saves down without
    failing any, and this is where that shows."""
    total = summary.retries
    if not any(total.values()):
        return []
    lines = [
        "",
        f"Retried requests to the durable tier (rank 0's): {total['storage']} by the storage client, "
        f"{total['upload']} by the pack",
    ]
    lines.append(f"{'#':>3}  {'STORAGE CLIENT':>14}  {'PACK':>6}")
    for inc in summary.incarnations:
        if any(inc.retries.values()):
            lines.append(f"{inc.index:>3}  {inc.retries.get('storage', 0):>14}  {inc.retries.get('upload', 0):>6}")
    lines.append(
        "STORAGE CLIENT: answers the S3 client retried on its own (throttling such as 503 SlowDown, server errors, "
        "lost connections); PACK: file transfers the pack sent again after the client gave up."
    )
    return lines


def _stragglers(summary: GoodputSummary) -> list[str]:
    """The ranks found slower than their peers (and replaced), from the ledger's straggler events."""
    events = [(inc.index, e) for inc in summary.incarnations for e in inc.events if e["e"].startswith("straggler")]
    if not events:
        return []
    lines = ["", "Stragglers: ranks persistently slower than their peers (#: the incarnation; per step):"]
    for index, event in events:
        if event["e"] == "straggler_replaced":
            lines.append(f"{index:>3}  step {event.get('step')}: rank {event.get('rank')} replaced by a spare")
            continue
        lines.append(
            f"{index:>3}  step {event.get('step')}: rank {event.get('rank')} at {event.get('ratio', 0):.2f}x "
            f"(compute {1e3 * event.get('extra_compute_s', 0):+.1f} ms, data wait "
            f"{1e3 * event.get('extra_data_s', 0):+.1f} ms; the others waited "
            f"{1e3 * event.get('others_wait_s', 0):.1f} ms in collectives)"
        )
    return lines


def run_report(run_dir: str, *, as_json: bool = False, plot: str | None = None) -> int:
    summary = summarize(run_dir)
    if plot:
        from resilience.goodput.plot import plot_timeline

        plot_timeline(summary, plot)
    if as_json:
        print(json.dumps(summary.to_dict(), indent=1))
    else:
        print(render_table(summary))
        if plot:
            print(f"\ntimeline written to {plot}")
    if plot and as_json:
        print(f"timeline written to {plot}", file=sys.stderr)
    return 0
