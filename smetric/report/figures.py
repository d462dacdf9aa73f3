"""Matplotlib renderings of the workload findings (the paper's Figures 5-9).

Figures are built on ``matplotlib.figure.Figure`` directly rather than through pyplot, so
rendering never touches pyplot's global figure registry or the importer's backend choice,
and PNGs are written by the Agg canvas that ``savefig`` picks for the file type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial, wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import matplotlib as mpl
import msgspec
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from smetric.report.terminal import REUSE_SOURCES, TRIGGER_SOURCES, shares
from smetric.trace.analysis.results import (
    Analysis,
    Balance,
    ReuseIntervals,
    ReuseShares,
    SessionUsage,
    Triggers,
)

if TYPE_CHECKING:  # matplotlib names its rc keys from 3.10 on, and only for type checkers
    from matplotlib.typing import RcKeyType

DPI = 120
COLORS = {
    "intra_session": "#2f6db5",
    "inter_session": "#f28e2b",
    "system_prompt": "#59a14f",
    "miss": "#d9d9d9",
    "user": "#e15759",
    "agent": "#2f6db5",
    "compaction": "#b07aa1",
    "unknown": "#bab0ac",
    "line": "#2f6db5",
    "accent": "#e15759",
}
LIGHT = frozenset({"miss", "unknown"})  # segments too pale for white labels
REUSE_LABELS = {**REUSE_SOURCES, "miss": "Miss (computed)"}
STYLE: dict[RcKeyType, Any] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.frameon": False,
}

S = TypeVar("S")


def _styled(build: Callable[[S], Figure]) -> Callable[[S], Figure]:
    """Apply the report style only while a figure is built, leaving global rcParams alone."""

    @wraps(build)
    def wrapper(section: S) -> Figure:
        with mpl.rc_context(STYLE):
            return build(section)

    return wrapper


def new_figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def percent_axis(ax: Axes, axis: Literal["x", "y"]) -> None:
    formatter = PercentFormatter(xmax=1, decimals=0)
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(formatter)


def _stacked_shares(
    ax: Axes, rows: Sequence[tuple[str, Mapping[str, float]]], labels: Mapping[str, str]
) -> None:
    """Draw one 100 % horizontal bar per row, labelling segments wide enough to read.

    Figures 5 and 7 are both "how does a whole split into parts" questions, so they share
    this layout: rows compare the same parts over two different wholes.
    """
    names = [name for name, _ in rows]
    left = np.zeros(len(rows))
    for key, label in labels.items():
        widths = np.array([split.get(key, 0.0) for _, split in rows])
        bars = ax.barh(names, widths, left=left, color=COLORS[key], label=label, height=0.6)
        texts = [f"{w:.1%}" if w >= 0.06 else "" for w in widths]
        ink = "black" if key in LIGHT else "white"
        ax.bar_label(bars, labels=texts, label_type="center", fontsize=9, color=ink)
        left += widths
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    percent_axis(ax, "x")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(labels))


@_styled
def reuse_figure(reuse: ReuseShares) -> Figure:
    """Figure 5: how much prefill an infinite KV store saves, and whose tokens it reuses."""
    ratio = reuse.ratio
    breakdown: dict[str, float] = msgspec.structs.asdict(reuse.breakdown)
    of_prompt = {key: ratio * share for key, share in breakdown.items()}
    of_prompt["miss"] = 1.0 - ratio
    fig = new_figure(8, 2.8)
    ax = fig.add_subplot()
    _stacked_shares(
        ax, [("All prompt tokens", of_prompt), ("Reused tokens", breakdown)], REUSE_LABELS
    )
    ax.set_title(f"Ideal KV-cache reuse (infinite store): {ratio:.1%} of prompt tokens hit")
    ax.set_xlabel("Share of tokens")
    return fig


@_styled
def reuse_intervals_figure(intervals: ReuseIntervals) -> Figure:
    """Figure 6: the reuse-interval CDF, log-x because intervals span seconds to hours."""
    x = np.asarray(intervals.cdf.x, dtype=float)
    y = np.asarray(intervals.cdf.y, dtype=float)
    positive = x > 0  # a log axis cannot place zero-second reuses; their mass stays in y
    fig = new_figure(8, 4.2)
    ax = fig.add_subplot()
    ax.plot(x[positive], y[positive], drawstyle="steps-post", color=COLORS["line"], lw=2)
    # Labels sit low beside each marker line: right of an increasing CDF's curve, that
    # area is empty; staggering keeps neighbouring decades from colliding.
    for row, (mark, share) in enumerate(intervals.within.items()):
        seconds = float(mark)
        ax.axvline(seconds, color="grey", ls="--", lw=0.8)
        ax.plot([seconds], [share], "o", color=COLORS["accent"])
        ax.text(seconds * 1.15, 0.04 + 0.08 * row, f"{share:.1%} ≤ {mark} s", fontsize=9)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    percent_axis(ax, "y")
    ax.set_xlabel("Reuse interval (seconds, log scale)")
    ax.set_ylabel("Share of reuses (CDF)")
    ax.set_title(f"KV-cache reuse interval, {intervals.clock} clock ({intervals.count:,} reuses)")
    return fig


@_styled
def triggers_figure(triggers: Triggers) -> Figure:
    """Figure 7: who sends the requests, by count and by token volume."""
    rows = [("Requests", shares(triggers.requests)), ("Tokens", shares(triggers.tokens))]
    fig = new_figure(8, 2.8)
    ax = fig.add_subplot()
    _stacked_shares(ax, rows, {key: key.capitalize() for key in TRIGGER_SOURCES})
    ax.set_title("What triggers requests")
    ax.set_xlabel("Share of requests / of tokens")
    return fig


def _lorenz_panel(ax: Axes, usage: SessionUsage) -> None:
    x = np.asarray(usage.lorenz.x, dtype=float)
    y = np.asarray(usage.lorenz.y, dtype=float)
    ax.plot([0, 1], [0, 1], color="grey", ls="--", lw=0.8, label="Perfect equality")
    ax.plot(x, y, color=COLORS["line"], lw=2, label=f"Sessions (Gini {usage.gini:.2f})")
    top = usage.top_share.top_10
    ax.plot([0.9], [1 - top], "o", color=COLORS["accent"])
    ax.annotate(
        f"top 10% of sessions use\n{top:.1%} of tokens",
        (0.9, 1 - top),
        xytext=(-130, 30),
        textcoords="offset points",
        fontsize=9,
        arrowprops={"arrowstyle": "->", "color": "grey"},
    )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    percent_axis(ax, "x")
    percent_axis(ax, "y")
    ax.set_xlabel("Cumulative share of sessions (lightest first)")
    ax.set_ylabel("Cumulative share of tokens")
    ax.set_title("Lorenz curve of token usage")
    ax.legend(loc="upper left")


def _per_session_panel(ax: Axes, usage: SessionUsage) -> None:
    tokens = np.asarray(usage.per_session_tokens, dtype=float)
    rank = np.arange(1, len(tokens) + 1)
    positive = tokens > 0  # sessions with no tokens have no place on a log axis
    ax.plot(rank[positive], tokens[positive], color=COLORS["line"], lw=2)
    ax.axhline(usage.mean, color=COLORS["accent"], ls="--", lw=1, label="Mean")
    ax.set_yscale("log")
    shown = "" if len(tokens) == usage.sessions else f" (top {len(tokens):,} shown)"
    ax.set_xlabel(f"Session rank by tokens{shown}")
    ax.set_ylabel("Tokens per session (log scale)")
    ax.set_title(f"Tokens per session, {usage.sessions:,} sessions")
    ax.legend(loc="upper right")


@_styled
def session_usage_figure(usage: SessionUsage) -> Figure:
    """Figure 8: how unevenly token usage is spread over sessions."""
    fig = new_figure(11, 4.2)
    lorenz, ranked = fig.subplots(1, 2)
    _lorenz_panel(lorenz, usage)
    _per_session_panel(ranked, usage)
    return fig


def _imbalance_panels(line: Axes, hist: Axes, balance: Balance) -> None:
    imbalance = balance.imbalance
    series = np.asarray(imbalance.series, dtype=float)
    first = balance.ramp_up_windows
    minutes = (first + np.arange(len(series))) * balance.window_s / 60
    line.plot(minutes, series, color=COLORS["line"], lw=1.5, marker=".", ms=4)
    for key, value, style in (("p50", imbalance.p50, ":"), ("max", imbalance.max, "--")):
        line.axhline(value, color=COLORS["accent"], ls=style, lw=1, label=key)
    line.axhline(1, color="grey", lw=0.8)
    line.set_xlabel("Time (minutes)")
    line.set_ylabel("Imbalance (max / mean tokens)")
    ramp = f", after {first} ramp-up window{'s' if first != 1 else ''}" if first else ""
    line.set_title(f"Per-window load imbalance, {balance.instances} instances{ramp}")
    line.legend(loc="upper right")
    hist.hist(series, bins=min(30, max(5, len(series) // 4)), color=COLORS["line"], alpha=0.8)
    hist.set_xlabel("Imbalance (max / mean)")
    hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    hist.set_ylabel("Windows")
    hist.set_title("Distribution")


def _heatmap_panel(fig: Figure, ax: Axes, balance: Balance) -> None:
    heat = np.asarray(balance.heatmap, dtype=float)
    span = heat.shape[1] * balance.window_s / 60
    image = ax.imshow(
        heat,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(0, span, heat.shape[0] - 0.5, -0.5),
    )
    fig.colorbar(image, ax=ax, label="Mean in-flight tokens", pad=0.01)
    ax.grid(False)
    ax.set_xlabel("Time (minutes)")
    ax.set_ylabel("Instance")
    ax.set_title(
        f"In-flight tokens per instance (arrivals {balance.arrivals}, "
        f"durations {balance.durations})"
    )


@_styled
def balance_figure(balance: Balance) -> Figure:
    """Figure 9: how evenly least-in-flight-tokens dispatch can spread the load."""
    fig = new_figure(11, 7.5)
    axes = fig.subplot_mosaic(
        [["line", "hist"], ["heat", "heat"]], width_ratios=[3, 1], height_ratios=[1, 1.2]
    )
    _imbalance_panels(axes["line"], axes["hist"], balance)
    _heatmap_panel(fig, axes["heat"], balance)
    return fig


def figures(result: Analysis) -> dict[str, Callable[[], Figure]]:
    """What each section with data to draw is drawn by, keyed by section name in figure
    order: absent sections and unmeasurable reuse have nothing to draw."""
    found: dict[str, Callable[[], Figure]] = {}
    if result.reuse.measurable:
        found["reuse"] = partial(reuse_figure, result.reuse)
    if result.reuse_intervals is not None:
        found["reuse_intervals"] = partial(reuse_intervals_figure, result.reuse_intervals)
    found["triggers"] = partial(triggers_figure, result.triggers)
    found["session_usage"] = partial(session_usage_figure, result.session_usage)
    found["balance"] = partial(balance_figure, result.balance)
    return found


def write_pngs(result: Analysis, out_dir: Path) -> dict[str, Path]:
    """Write ``<section>.png`` per plottable section; keys are section names, in figure order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, draw in figures(result).items():
        path = out_dir / f"{name}.png"
        draw().savefig(path, dpi=DPI)
        written[name] = path
    return written
