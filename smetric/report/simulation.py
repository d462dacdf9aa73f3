"""Matplotlib renderings of simulated runs and sweeps (the paper's Figures 11, 12, 14-17, 25).

Built like ``figures``: ``Figure`` objects without pyplot, the report style applied only
while figures are built. Each policy keeps one colour in every figure (``palette``), so a
reader can follow a policy from the TPS bars to the latency CDFs, and from one command's
figures to another's, without re-reading legends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib as mpl
import numpy as np
import polars as pl
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from smetric.metrics.results import (
    BestRate,
    Guard,
    HitSplit,
    Imbalance,
    KneeSummary,
    MeanPoint,
    Percentiles,
    PlanResult,
    Reuse,
    RunSummary,
    SensitivityPoint,
    SweepResult,
)
from smetric.metrics.summary import measured_windows
from smetric.report.figures import COLORS, DPI, STYLE, new_figure, percent_axis
from smetric.report.palette import policy_color, policy_colors
from smetric.report.terminal import pct, seconds, times

TIERS = {"local": "Local-tier hit", "global": "Global-tier hit", "miss": "Miss (computed)"}
FADED = 0.35  # alpha of the secondary layer drawn in a policy's colour (total TPS, global hits)
NEUTRAL = "#555555"  # legend swatches that explain a layer rather than name a policy
LATENCIES = {"ttft_s": "Time to first token", "tpot_s": "Time per output token"}

Summaries = Mapping[str, RunSummary]


def _policy_axis(ax: Axes, labels: Sequence[str]) -> None:
    """One horizontal row per policy: long specs such as ``linear:lam=0.95`` fit as y labels."""
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # first policy on top, as in the policy list
    ax.grid(axis="y", visible=False)


def _rows_height(rows: int) -> float:
    return 1.3 + 0.45 * rows


def _key(fig: Figure, handles: Sequence[Patch]) -> None:
    """A figure-wide key below the axes, where it cannot cover bars or their labels."""
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4))


def _policy_legend(fig: Figure, colors: Mapping[str, str]) -> None:
    """Key multi-panel figures whose panels all show every policy once, not per panel."""
    _key(fig, [Patch(color=color, label=policy) for policy, color in colors.items()])


def _tps_figure(summaries: Summaries, colors: Mapping[str, str]) -> Figure:
    """How much of each policy's throughput counts: TPS within SLO over all completed TPS."""
    policies = list(summaries)
    y = np.arange(len(policies))
    total = np.array([summaries[p].tps for p in policies])
    within = np.array([summaries[p].tps_within_slo for p in policies])
    fig = new_figure(8, _rows_height(len(policies)) + 0.3)
    ax = fig.add_subplot()
    behind = ax.barh(y, total, height=0.7, color=[to_rgba(colors[p], FADED) for p in policies])
    ax.barh(y, within, height=0.45, color=[colors[p] for p in policies])
    labels = [
        f"{w:,.0f} of {t:,.0f} tok/s ({pct(summaries[p].slo_attainment)} met SLO)"
        for p, w, t in zip(policies, within, total, strict=True)
    ]
    ax.bar_label(behind, labels=labels, padding=4, fontsize=9)
    ax.set_xlim(0, max(total.max(initial=0.0), 1.0) * 1.6)  # room for the labels
    _policy_axis(ax, policies)
    disaggregated = any(summary.pd is not None for summary in summaries.values())
    ax.set_xlabel(f"Tokens per second ({'prompt' if disaggregated else 'prompt + output'})")
    ax.set_title("TPS within SLO and total TPS")
    _key(
        fig,
        [
            Patch(color=NEUTRAL, label="TPS within SLO"),
            Patch(color=to_rgba(NEUTRAL, FADED), label="Total TPS (completed requests)"),
        ],
    )
    return fig


def _reuse_panel(ax: Axes, rows: Sequence[tuple[str, Reuse | HitSplit, str]]) -> None:
    """100 % bars of prompt tokens per row: local hits solid, global hits hatched (Fig. 11b)."""
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    splits = [{"local": s.local, "global": s.global_, "miss": s.miss} for _, s, _ in rows]
    for tier in TIERS:
        widths = np.array([split[tier] for split in splits])
        if tier == "miss":
            style: dict[str, Any] = {"color": COLORS["miss"]}
        else:
            faded = FADED if tier == "global" else 1.0
            style = {"color": [to_rgba(color, faded) for *_, color in rows]}
            if tier == "global":
                style |= {"hatch": "///", "edgecolor": [color for *_, color in rows], "lw": 0}
        bars = ax.barh(y, widths, left=left, height=0.6, **style)
        texts = [pct(w) if w >= 0.06 else "" for w in widths]
        ink = "white" if tier == "local" else "black"
        ax.bar_label(bars, labels=texts, label_type="center", fontsize=9, color=ink)
        left += widths
    ax.set_xlim(0, 1)
    _policy_axis(ax, [label for label, *_ in rows])
    percent_axis(ax, "x")


def _tier_legend(fig: Figure) -> None:
    tiers = [
        Patch(color=NEUTRAL, label=TIERS["local"]),
        Patch(
            facecolor=to_rgba(NEUTRAL, FADED),
            edgecolor=NEUTRAL,
            hatch="///",
            lw=0,
            label=TIERS["global"],
        ),
        Patch(color=COLORS["miss"], label=TIERS["miss"]),
    ]
    _key(fig, tiers)


def _reuse_figure(summaries: Summaries, colors: Mapping[str, str]) -> Figure:
    """Where each policy's prompt tokens come from: local tier, global tier or recompute."""
    fig = new_figure(8, _rows_height(len(summaries)) + 0.3)
    ax = fig.add_subplot()
    _reuse_panel(ax, [(p, s.reuse, colors[p]) for p, s in summaries.items()])
    ax.set_xlabel("Share of prompt tokens")
    ax.set_title("KV-cache reuse by tier")
    _tier_legend(fig)
    return fig


def _cdf(ax: Axes, values: Iterable[float | None], color: str, label: str) -> None:
    """Empirical CDF; an empty sample still gets its legend entry so no policy goes missing."""
    data = np.array([v for v in values if v is not None], dtype=float)
    data = np.sort(data[np.isfinite(data)])
    ax.plot(
        data,
        np.arange(1, len(data) + 1) / max(len(data), 1),
        drawstyle="steps-post",
        color=color,
        lw=1.8,
        label=label,
    )


def _cdf_axis(ax: Axes, xlabel: str) -> None:
    ax.set_ylim(0, 1.02)
    percent_axis(ax, "y")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("Share (CDF)")
    ax.legend(loc="upper left", fontsize=8)  # the empty corner of a rising CDF


def _load_name(summaries: Summaries) -> str:
    """What load means: prefill tokens under disaggregation (Figure 21b), else tokens."""
    if any(summary.pd is not None for summary in summaries.values()):
        return "in-flight prefill tokens"
    return "in-flight tokens"


def _mean_imbalance(imbalance: Imbalance) -> str:
    """The paper's load-imbalance figure of merit; a run with no busy window has none."""
    mean = imbalance.mean
    if math.isnan(mean):
        return "no busy windows"
    return f"mean {times(mean)}"


def _imbalance_figure(summaries: Summaries, colors: Mapping[str, str]) -> Figure:
    """Figure 14: how often, and how badly, each policy piles load onto one instance."""
    fig = new_figure(8, 4.2)
    ax = fig.add_subplot()
    for policy, summary in summaries.items():
        imbalance = summary.imbalance
        _cdf(ax, imbalance.series, colors[policy], f"{policy} ({_mean_imbalance(imbalance)})")
    ax.axvline(1, color="grey", lw=0.8)
    _cdf_axis(ax, f"Per-window imbalance (max / mean {_load_name(summaries)}; 1.0x = balanced)")
    ax.set_title("Distribution of per-window load imbalance")
    return fig


def _heatmaps_figure(summaries: Summaries, colors: Mapping[str, str]) -> Figure:
    """Figure 15b: per-instance load over time, each policy scaled to its own p99 so that
    the pattern (hot instances vs an even spread) compares even when volumes differ. Only
    the windows after the warm-up are drawn: the ones the imbalance in the titles, the
    tables and the other figures count."""
    columns = min(len(summaries), 3)
    rows = math.ceil(len(summaries) / columns)
    fig = new_figure(11, 0.4 + 2.6 * rows)
    # One scale for all panels: 1.0 is a policy's own p99, so its top 1 % of cells saturate.
    scale = ScalarMappable(Normalize(0, 1), "viridis")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, (policy, summary) in zip(axes, summaries.items(), strict=False):
        window_s = summary.window_s
        first = measured_windows(summary.warmup_s, window_s)
        heat = np.asarray(summary.load_heatmap, dtype=float)
        if heat.ndim == 2:
            heat = heat[:, first:]
        p99 = float(np.percentile(heat, 99)) if heat.size else 0.0
        start = first * window_s / 60
        minutes = start + (heat.shape[1] * window_s / 60 if heat.ndim == 2 else 1)
        if minutes > start:
            ax.imshow(
                heat / p99 if p99 > 0 else heat,
                aspect="auto",
                interpolation="nearest",
                cmap=scale.cmap,
                norm=scale.norm,
                extent=(start, minutes, heat.shape[0] - 0.5 if heat.ndim == 2 else 0.5, -0.5),
            )
        else:  # a run no longer than its warm-up
            ax.text(0.5, 0.5, "no windows after the warm-up", ha="center", transform=ax.transAxes)
        ax.grid(False)
        ax.set_title(f"{policy} ({_mean_imbalance(summary.imbalance)})", fontsize=10)
        ax.title.set_color(colors[policy])
        ax.set_xlabel("Time (minutes)")
        ax.set_ylabel("Instance")
    for ax in axes[len(summaries) :]:
        ax.set_visible(False)
    load = _load_name(summaries)
    fig.colorbar(scale, ax=axes.tolist(), label=f"{load.capitalize()} / policy's p99", pad=0.01)
    fig.suptitle(
        f"{load.capitalize()} per instance after the warm-up (load imbalance in brackets)",
        weight="bold",
    )
    return fig


def _seconds_axis(ax: Axes) -> None:
    """Log time axis labelled in ms / s / min: latencies span several decades."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 3.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: seconds(value)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _latency_label(policy: str, percentiles: Percentiles) -> str:
    p50, p90 = percentiles.p50, percentiles.p90
    if p50 is None or p90 is None:
        return f"{policy} (none completed)"
    return f"{policy} (p50 {seconds(p50)}, p90 {seconds(p90)})"


def _latency_figure(
    summaries: Summaries, tables: Mapping[str, pl.DataFrame], colors: Mapping[str, str]
) -> Figure:
    """Figure 17: TTFT and TPOT of every completed request, met SLO or not, as the paper
    counts them. TPOT needs a second output token, so single-token replies are left out."""
    # Prefill-only disaggregated runs (Figure 23) have no decode, so no TPOT to plot.
    decoding = any(s.pd is None or s.pd.mode != "prefill-only" for s in summaries.values())
    metrics = list(LATENCIES) if decoding else ["ttft_s"]
    fig = new_figure(11 if decoding else 6, 4.4)
    axes = dict(zip(metrics, fig.subplots(1, len(metrics), squeeze=False)[0], strict=True))
    for policy, summary in summaries.items():
        done = tables[policy].filter(pl.col("completed"))
        samples = {
            "ttft_s": done["ttft_s"],
            "tpot_s": done.filter(pl.col("output_tokens") > 1)["tpot_s"],
        }
        for metric in metrics:
            sample = samples[metric]
            positive = [v for v in sample.to_list() if v is not None and v > 0]  # log axis
            label = _latency_label(policy, summary.ttft_s if metric == "ttft_s" else summary.tpot_s)
            _cdf(axes[metric], positive, colors[policy], label)
    for metric, ax in axes.items():
        _seconds_axis(ax)
        _cdf_axis(ax, f"{LATENCIES[metric]} (log scale)")
        ax.set_title(f"{LATENCIES[metric]}, completed requests")
    return fig


def _stickiness_figure(summaries: Summaries, colors: Mapping[str, str]) -> Figure:
    """Figure 12: whether a policy keeps follow-ups on the instance of their session's
    first request, and of their own conversation's (per agent: a sub-agent is a
    conversation of its own), the two shares the tables give."""
    policies = list(summaries)
    fig = new_figure(8, _rows_height(len(policies)) + 0.4)
    ax = fig.add_subplot()
    rows = np.arange(len(policies))
    for offset, key, alpha in ((-0.2, "session", 1.0), (0.2, "agent", 0.5)):
        shares = [summaries[p].stickiness.to_builtins()[key] for p in policies]
        bars = ax.barh(
            rows + offset,
            [0.0 if s is None else s for s in shares],
            height=0.38,
            color=[colors[p] for p in policies],
            alpha=alpha,
        )
        labels = [f"{key}: " + ("no follow-ups" if s is None else pct(s)) for s in shares]
        ax.bar_label(bars, labels=labels, padding=4, fontsize=8)
    ax.set_xlim(0, 1.3)
    ax.set_xticks(np.linspace(0, 1, 6))
    percent_axis(ax, "x")
    _policy_axis(ax, policies)
    ax.set_xlabel("Share of follow-up requests")
    ax.set_title(
        "Follow-ups served by their session's first instance (solid) and their agent's (light)"
    )
    return fig


def _save(builds: Mapping[str, Callable[[], Figure]], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    with mpl.rc_context(STYLE):
        for name, build in builds.items():
            path = out / f"{name}.png"
            build().savefig(path, dpi=DPI)
            written[name] = path
    return written


def write_simulation_pngs(
    summaries: Summaries, tables: Mapping[str, pl.DataFrame], out: Path
) -> dict[str, Path]:
    """Write one run's figures; keys are figure names, policies keep the summaries' order."""
    colors = policy_colors(summaries)
    return _save(
        {
            "tps": partial(_tps_figure, summaries, colors),
            "reuse": partial(_reuse_figure, summaries, colors),
            "imbalance": partial(_imbalance_figure, summaries, colors),
            "heatmaps": partial(_heatmaps_figure, summaries, colors),
            "latency": partial(_latency_figure, summaries, tables, colors),
            "stickiness": partial(_stickiness_figure, summaries, colors),
        },
        out,
    )


@dataclass(frozen=True)
class SweepFigures:
    """What the sweep figures draw (Figs. 11, 15a, 16): each policy's best TPS within SLO
    per global tier, and TPS and hit split at every (tier, policy, rate) point. Built from
    a sweep (``sweep_figures``) or from ``reproduce``'s knees and rate sweep."""

    policies: Sequence[str]
    provisionings: Sequence[str]
    rates: Sequence[float]
    best: Mapping[str, Mapping[str, BestRate]]
    points: Mapping[tuple[str, str, float], MeanPoint]
    # Disaggregated runs count prompt tokens (the paper's prefill TPS), others all.
    prompt_tokens: bool = False
    title: str = "Maximum TPS within SLO over the offered-rate sweep"


def sweep_figures(sweep: SweepResult) -> SweepFigures:
    def point(summary: RunSummary) -> MeanPoint:
        reuse = summary.reuse
        split = HitSplit(local=reuse.local, global_=reuse.global_, miss=reuse.miss)
        return MeanPoint(tps_within_slo=summary.tps_within_slo, stdev=0.0, reuse=split)

    return SweepFigures(
        policies=sweep.policies,
        provisionings=sweep.provisionings,
        rates=sweep.rates,
        best=sweep.max_tps,
        points={(r.global_, r.policy, r.rate): point(r.summary) for r in sweep.runs},
        prompt_tokens=any(r.summary.pd is not None for r in sweep.runs),
    )


def _tokens_unit(sweep: SweepFigures) -> str:
    return "prompt tok/s" if sweep.prompt_tokens else "tok/s"


def _max_tps_figure(sweep: SweepFigures, colors: Mapping[str, str]) -> Figure:
    """Figures 11a/16a: each policy's best TPS within SLO over the rate sweep, per global
    tier, grouped by provisioning because the question is who wins at each one."""
    provisionings, policies = sweep.provisionings, sweep.policies
    width = 0.8 / len(policies)
    x = np.arange(len(provisionings))
    fig = new_figure(8, 4.6)
    ax = fig.add_subplot()
    for i, policy in enumerate(policies):
        best = [sweep.best[g][policy] for g in provisionings]
        tps = [b.tps for b in best]
        # A sweep over seeds plots each mean with its standard deviation.
        sd = [b.stdev or 0.0 for b in best] if best[0].stdev is not None else None
        offset = (i - (len(policies) - 1) / 2) * width
        bars = ax.bar(x + offset, tps, width * 0.9, color=colors[policy], yerr=sd, capsize=2)
        labels = [f"{v:,.0f}" for v in tps]
        ax.bar_label(bars, labels=labels, padding=2, fontsize=8, rotation=90)
    ax.margins(y=0.2)  # headroom for the rotated value labels
    ax.set_xticks(x, provisionings)
    ax.grid(axis="x", visible=False)
    ax.set_xlabel("Global-tier provisioning")
    ax.set_ylabel(f"Max TPS within SLO ({_tokens_unit(sweep)})")
    ax.set_title(sweep.title)
    _policy_legend(fig, colors)
    return fig


def _tps_vs_rate_figure(sweep: SweepFigures, colors: Mapping[str, str]) -> Figure:
    """Figure 15a: where each policy's TPS within SLO saturates as the offered rate grows."""
    runs = sweep.points
    provisionings, rates = sweep.provisionings, sorted(sweep.rates)
    # At least 8 inches: the policy key below the panels needs the room.
    fig = new_figure(min(max(4.0 * len(provisionings), 8), 13), 4.4)
    axes = fig.subplots(1, len(provisionings), sharey=True, squeeze=False).ravel()
    for ax, level in zip(axes, provisionings, strict=True):
        for policy in sweep.policies:
            tps = [runs[level, policy, r].tps_within_slo for r in rates]
            ax.plot(rates, tps, color=colors[policy], marker="o", ms=4, lw=1.8)
        ax.set_title(f"Global tier: {level}")
        ax.set_xlabel("Offered rate (sessions/s)")
    return _tps_panels(fig, axes[0], f"TPS within SLO ({_tokens_unit(sweep)})", colors)


def _tps_panels(fig: Figure, first: Axes, ylabel: str, colors: Mapping[str, str]) -> Figure:
    """Finish a row of TPS-vs-load panels that share their y axis from zero."""
    first.set_ylabel(ylabel)
    first.set_ylim(bottom=0)
    _policy_legend(fig, colors)
    return fig


def _reuse_by_provisioning_figure(sweep: SweepFigures, colors: Mapping[str, str]) -> Figure:
    """Figures 11b/16b: the hit split that produced each max-TPS bar, so a TPS gap can be
    traced to local hits lost or to recompute."""
    runs = sweep.points
    provisionings, policies = sweep.provisionings, sweep.policies
    fig = new_figure(8, len(provisionings) * (0.5 + 0.45 * len(policies)) + 0.9)
    axes = fig.subplots(len(provisionings), 1, sharex=True, squeeze=False).ravel()
    for ax, level in zip(axes, provisionings, strict=True):
        rows = []
        for policy in policies:
            rate = sweep.best[level][policy].rate
            rows.append((f"{policy} @ {rate:g}/s", runs[level, policy, rate].reuse, colors[policy]))
        _reuse_panel(ax, rows)
        ax.set_title(f"Global tier: {level}", loc="left", fontsize=10)
    axes[-1].set_xlabel("Share of prompt tokens, at each policy's max-TPS rate (sessions/s)")
    _tier_legend(fig)
    return fig


SWEEP_FIGURES = {
    "max_tps": _max_tps_figure,
    "tps_vs_rate": _tps_vs_rate_figure,
    "reuse_by_provisioning": _reuse_by_provisioning_figure,
}


def write_sweep_pngs(
    sweep: SweepFigures, out: Path, names: Sequence[str] = tuple(SWEEP_FIGURES)
) -> dict[str, Path]:
    """Write a sweep's figures (``names`` of them); policies keep the sweep's order and so
    its colours."""
    colors = policy_colors(sweep.policies)
    return _save({name: partial(SWEEP_FIGURES[name], sweep, colors) for name in names}, out)


def _guard_figure(guard: Mapping[str, Guard]) -> Figure:
    """Figure 14: per-window load imbalance with and without SMetric's overload guard, as
    the paper plots it (its distribution) and over time, where a reader sees when the
    guard acts."""
    colors = policy_colors(guard)
    fig = new_figure(11, 4.4)
    spread, timeline = fig.subplots(1, 2)
    for spec, data in guard.items():
        label = f"{spec} (mean {times(data.mean)})" if data.mean else spec
        _cdf(spread, data.windows, colors[spec], label)
        width = data.window_s / 60
        minutes = [(i + 0.5) * width for i in range(len(data.over_time))]
        values = [math.nan if v is None else v for v in data.over_time]
        timeline.plot(minutes, values, color=colors[spec], lw=1.4, label=spec)
    warmup = next(iter(guard.values())).warmup_s / 60
    if warmup > 0:
        timeline.axvspan(0, warmup, color="grey", alpha=0.12, lw=0, label="warm-up (left out)")
    spread.axvline(1, color="grey", lw=0.8)
    _cdf_axis(spread, "Per-window imbalance (max / mean in-flight tokens)")
    spread.set_title("Distribution over windows after the warm-up (all seeds)")
    timeline.set_xlabel("Time (minutes)")
    timeline.set_ylabel("Imbalance (max / mean)")
    timeline.set_ylim(bottom=1)
    timeline.set_title("Over time (first seed)")
    timeline.legend(loc="upper right", fontsize=8)
    return fig


def _sensitivity_figure(sensitivity: Mapping[str, Sequence[SensitivityPoint]]) -> Figure:
    """Figure 25: SMetric's TPS within SLO (line) and hit split (bars) as OVERLOAD and
    HIT_RATIO move away from their defaults."""
    names = {
        "overload": "OVERLOAD (not_overloaded guard)",
        "hit_ratio": "HIT_RATIO (evicted guard)",
    }
    fig = new_figure(11, 4.4)
    axes = fig.subplots(1, len(names), squeeze=False).ravel()
    color = policy_color("smetric")
    for ax, (param, title) in zip(axes, names.items(), strict=True):
        points = sensitivity[param]
        x = np.arange(len(points))
        local = np.array([p.reuse.local for p in points])
        remote = np.array([p.reuse.global_ for p in points])
        ax.bar(x, local, 0.6, color=to_rgba(color, FADED))
        ax.bar(x, remote, 0.6, bottom=local, color="white", edgecolor=color, hatch="///", lw=0)
        ax.set_ylim(0, 1)
        percent_axis(ax, "y")
        ax.set_ylabel("Share of prompt tokens (hits)")
        ax.set_xticks(x, [p.label for p in points])
        ax.grid(axis="x", visible=False)
        ax.set_xlabel(title)
        line = ax.twinx()
        line.plot(x, [p.tps_within_slo for p in points], color=NEUTRAL, marker="o", lw=1.8)
        line.set_ylim(bottom=0)
        line.set_ylabel("TPS within SLO (tok/s)")
        line.grid(False)
    _key(
        fig,
        [
            Patch(color=to_rgba(color, FADED), label=TIERS["local"]),
            Patch(facecolor="white", edgecolor=color, hatch="///", lw=0, label=TIERS["global"]),
            Patch(color=NEUTRAL, label="TPS within SLO (line)"),
        ],
    )
    return fig


def write_guard_png(guard: Mapping[str, Guard], path: Path) -> Path:
    """Figure 14 from ``reproduce``'s guard data, one series per SMetric setting."""
    return _save({path.stem: partial(_guard_figure, guard)}, path.parent)[path.stem]


def write_sensitivity_png(
    sensitivity: Mapping[str, Sequence[SensitivityPoint]], path: Path
) -> Path:
    """Figure 25 from ``reproduce``'s sensitivity data."""
    return _save({path.stem: partial(_sensitivity_figure, sensitivity)}, path.parent)[path.stem]


def _knee_figure(summary: KneeSummary, colors: Mapping[str, str]) -> Figure:
    """Every probe of each policy's knee search, one panel per cell: the curve each knee
    sits on, so a reader can see how sharp it is and how much the search explored."""
    cells = summary.cells
    fig = new_figure(min(4.0 * len(cells), 16), 4.4)
    axes = fig.subplots(1, len(cells), sharey=True, squeeze=False).ravel()
    for ax, cell in zip(axes, cells, strict=True):
        for policy, knee in cell.knees.items():
            probes = sorted(knee.probes.items())
            ax.plot(*zip(*probes, strict=True), color=colors[policy], marker="o", ms=3, lw=1.5)
            ax.plot([knee.load], [knee.mean], color=colors[policy], marker="*", ms=11)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"Global tier: {cell.global_}, {cell.kv_load} load")
        ax.set_xlabel("Offered load (log)")
    return _tps_panels(fig, axes[0], "TPS within SLO, mean over seeds (tok/s)", colors)


def write_knee_png(summary: KneeSummary, path: Path) -> Path:
    """The knee searches' probes (``smetric knee``), policies in the summary's order."""
    colors = policy_colors(summary.policies)
    return _save({path.stem: partial(_knee_figure, summary, colors)}, path.parent)[path.stem]


def _plan_figure(summary: PlanResult, colors: Mapping[str, str]) -> Figure:
    """TPS within SLO at the trace's own load against instance count (``smetric plan``),
    one panel per global tier; the knee's TPS (what the count could serve at most) faded,
    each policy's plan starred."""
    tiers = summary.globals
    fig = new_figure(min(4.0 * len(tiers), 16), 4.4)
    axes = fig.subplots(1, len(tiers), sharey=True, squeeze=False).ravel()
    for ax, tier in zip(axes, tiers, strict=True):
        for policy, curves in summary.curves.items():
            points = curves[tier]
            if not points:
                continue
            counts = [p.instances for p in points]
            color = colors[policy]
            ax.plot(counts, [p.tps_within_slo for p in points], color=color, marker="o", ms=3)
            knee = [p.knee_tps_within_slo for p in points]
            ax.plot(counts, knee, color=to_rgba(color, FADED), ls="--", lw=1)
            plan = summary.plans[policy]
            if plan is not None and plan.global_ == tier:
                best = next(p for p in points if p.instances == plan.instances)
                ax.plot([best.instances], [best.tps_within_slo], color=color, marker="*", ms=12)
        ax.set_title(f"Global tier: {tier}")
        ax.set_xlabel("Instances")
        ax.xaxis.get_major_locator().set_params(integer=True)
    return _tps_panels(fig, axes[0], "TPS within SLO (tok/s); dashed: at the knee", colors)


def write_plan_png(summary: PlanResult, path: Path) -> Path:
    """``smetric plan``'s curves, policies in the summary's order."""
    colors = policy_colors(summary.policies)
    return _save({path.stem: partial(_plan_figure, summary, colors)}, path.parent)[path.stem]
