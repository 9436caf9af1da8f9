"""The report's picture: where the time went (one stacked bar) and when (one lane per incarnation)."""

from __future__ import annotations

from typing import Any

from resilience.errors import ResilienceError
from resilience.goodput.report import duration, headline
from resilience.goodput.summary import BUCKETS, LABELS, GoodputSummary, Incarnation

COLORS = {
    "productive": "#2e9e44",
    "data_wait": "#f28e2b",
    "checkpoint": "#4e79a7",
    "restore": "#9c6fc4",
    "startup": "#b07a4f",
    "lost": "#e15759",
    "emergency": "#e377c2",
    "other": "#b8b8b8",
    "downtime": "#eeeeee",
}
# Drawing order inside a span: where the time went first is unknown, so a fixed order keeps lanes readable.
LANE_ORDER = ("startup", "restore", "productive", "lost", "data_wait", "checkpoint", "emergency", "other")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ResilienceError("--plot needs matplotlib: pip install 'training-resilience[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _unit(wall_s: float) -> tuple[float, str]:
    if wall_s < 120:
        return 1.0, "seconds"
    if wall_s < 3 * 3600:
        return 60.0, "minutes"
    return 3600.0, "hours"


def plot_timeline(summary: GoodputSummary, path: str) -> None:
    """Write a PNG: buckets as a share of wall time, then each incarnation's lane on one time axis."""
    plt = _pyplot()
    lanes = len(summary.incarnations)
    fig, (bar, timeline) = plt.subplots(
        2, 1, figsize=(13, 2.6 + 0.75 * lanes), gridspec_kw={"height_ratios": [1.1, 0.9 + 0.75 * lanes]}
    )
    _bucket_bar(bar, summary)
    _lanes(timeline, summary)
    fig.suptitle(headline(summary), fontsize=13, fontweight="bold")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bucket_bar(ax: Any, summary: GoodputSummary) -> None:
    left = 0.0
    for name in BUCKETS:
        pct = 100.0 * summary.buckets[name] / summary.wall_s if summary.wall_s > 0 else 0.0
        ax.barh(
            0,
            pct,
            left=left,
            color=COLORS[name],
            edgecolor="white",
            hatch="//" if name == "downtime" else None,
            label=f"{LABELS[name]} {pct:.1f}% ({duration(summary.buckets[name])})",
        )
        if pct >= 6:
            ax.text(
                left + pct / 2,
                0,
                f"{pct:.0f}%",
                ha="center",
                va="center",
                fontsize=10,
                fontweight="bold",
                color="black" if name in ("other", "downtime") else "white",
            )
        left += pct
    ax.set_xlim(0, 100)
    ax.set_yticks([])
    ax.set_xticks(range(0, 101, 10), [f"{p}%" for p in range(0, 101, 10)], fontsize=8)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=9, frameon=False)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _lanes(ax: Any, summary: GoodputSummary) -> None:
    scale, unit = _unit(summary.wall_s)
    origin = summary.start
    last = summary.incarnations[-1]
    for inc in summary.incarnations:
        y = -inc.index
        segments: dict[str, list[tuple[float, float]]] = {name: [] for name in LANE_ORDER}
        for span in inc.spans:
            x = span.t0
            parts = dict(span.seconds)
            parts["productive"] = parts.get("productive", 0.0) - span.lost_s
            parts["lost"] = span.lost_s
            for name in LANE_ORDER:
                width = parts.get(name, 0.0)
                if width > 0:
                    segments[name].append(((x - origin) / scale, width / scale))
                    x += width
        for name, spans in segments.items():
            if spans:
                ax.broken_barh(spans, (y - 0.3, 0.6), facecolors=COLORS[name], linewidth=0)
        if inc.index:
            ax.broken_barh(
                [((inc.start - inc.downtime_before_s - origin) / scale, inc.downtime_before_s / scale)],
                (y - 0.3, 0.6),
                facecolors=COLORS["downtime"],
                edgecolor="#999999",
                hatch="//",
                linewidth=0.5,
            )
        _markers(ax, inc, y, origin, scale, last=inc is last)
    ax.set_yticks([-inc.index for inc in summary.incarnations])
    ax.set_yticklabels([_lane_label(inc) for inc in summary.incarnations], fontsize=9)
    ax.set_ylim(-len(summary.incarnations) + 0.2, 0.8)
    ax.set_xlim(0, max(summary.wall_s, 1.0) / scale * 1.12)
    ax.plot([], [], "v", color=COLORS["checkpoint"], linestyle="none", label="checkpoint save")
    ax.plot([], [], "X", color="#b00000", linestyle="none", label="fault")
    ax.legend(loc="upper right", fontsize=8, frameon=False)
    ax.set_xlabel(f"{unit} since the run started")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _lane_label(inc: Incarnation) -> str:
    restart = f", restart {inc.restart_count}" if inc.restart_count is not None else ""
    return f"#{inc.index} pid {inc.pid}{restart}"


def _markers(ax: Any, inc: Incarnation, y: float, origin: float, scale: float, *, last: bool) -> None:
    def at(t: float) -> float:
        return (t - origin) / scale

    stalls = [at(e["t"]) for e in inc.events if e["e"] == "checkpoint"]
    if stalls:
        ax.plot(stalls, [y + 0.4] * len(stalls), "v", color=COLORS["checkpoint"], markersize=5, linestyle="none")
    for event in inc.events:
        if event["e"] == "fault" or event["e"] == "save_failed":
            ax.plot([at(event["t"])], [y], "X", color="#b00000", markersize=11, markeredgecolor="white")
            ax.annotate(
                str(event.get("reason") or "save failed")[:40],
                (at(event["t"]), y - 0.32),
                fontsize=8,
                color="#b00000",
                ha="center",
                va="top",
            )
    if inc.index and inc.restored_step is not None:
        label = f"resumed at step {inc.restored_step}" + (f", {inc.redone_steps} redone" if inc.redone_steps else "")
        ax.annotate(label, (at(inc.start), y - 0.34), fontsize=8, ha="left", va="top", color="#333333")
    ended = inc.end_reason or ("running?" if last else "killed")
    reached = f" at step {inc.last_step}" if inc.last_step is not None else ""
    ax.annotate(
        f"{ended}{reached}",
        (at(inc.end), y),
        xytext=(10, 0),
        textcoords="offset points",
        fontsize=8,
        va="center",
        color="#b00000" if inc.failed else "#333333",
        fontweight="bold" if inc.failed else "normal",
    )
