"""``smetric reproduce``'s outputs: figures, one self-contained ``report.html`` and
``validation.md`` (also a stamped results page with ``--page``), all from one list of
sections so the page and the Markdown always show the same numbers."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import jinja2
import polars as pl
from markupsafe import Markup, escape

from smetric.core.policies import is_ours
from smetric.eval.paper import comparisons, pct, seconds, times
from smetric.eval.reproduce import GUARD_OFF
from smetric.metrics.results import (
    QUANTILES,
    WAYS,
    BestRate,
    HitSplit,
    KneeSummary,
    ReproduceResult,
    RunSummary,
)
from smetric.report.knee import knee_rows
from smetric.report.markdown import markdown_table
from smetric.report.simulation import (
    SweepFigures,
    write_guard_png,
    write_knee_png,
    write_sensitivity_png,
    write_simulation_pngs,
    write_sweep_pngs,
)
from smetric.sim.knee import knee_summary


class Section(NamedTuple):
    title: str
    caption: str
    figures: tuple[str, ...]  # names of PNGs in the result folder
    head: tuple[str, ...]
    rows: list[list[str]]


def kilo(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:,.1f}k"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def tier_knees(result: ReproduceResult) -> KneeSummary:
    """The tiers' knees as ``smetric knee``'s summary (its table and plot read it)."""
    load = result.config["cluster"]["kv_load"]
    knees = {
        (tier, load, p): v.knee
        for tier, cell in result.tiers.items()
        for p, v in cell.policies.items()
    }
    return knee_summary([(tier, load) for tier in result.tiers], result.policies, knees)


def tier_sweep(result: ReproduceResult) -> SweepFigures:
    """The knees drawn as a sweep's max-TPS and hit-split figures: each policy's point at
    its knee, per tier."""
    tiers = result.tiers
    return SweepFigures(
        policies=result.policies,
        provisionings=list(tiers),
        rates=[],
        best={
            t: {p: BestRate(tps=v.knee.mean, rate=v.knee.load) for p, v in c.policies.items()}
            for t, c in tiers.items()
        },
        points={(t, p, v.knee.load): v for t, c in tiers.items() for p, v in c.policies.items()},
        title="Max TPS within SLO at each policy's knee (mean over seeds)",
    )


def rate_sweep(result: ReproduceResult) -> SweepFigures:
    """The full tier's rate sweep drawn as a sweep's (one provisioning)."""
    sweep = result.rate_sweep
    return SweepFigures(
        policies=result.policies,
        provisionings=["full"],
        rates=sweep.rates,
        best={},
        points={
            ("full", p, rate): point
            for p, points in sweep.policies.items()
            for rate, point in zip(sweep.rates, points, strict=True)
        },
    )


def write_figures(
    result: ReproduceResult,
    summaries: Mapping[str, RunSummary],
    tables: Mapping[str, pl.DataFrame],
    out: Path,
) -> dict[str, Path]:
    """Every figure of the report, by name."""
    pngs = dict(write_sweep_pngs(tier_sweep(result), out, ("max_tps", "reuse_by_provisioning")))
    pngs["knee"] = write_knee_png(tier_knees(result), out / "knee.png")
    pngs |= write_sweep_pngs(rate_sweep(result), out, ("tps_vs_rate",))
    at_load = write_simulation_pngs(dict(summaries), dict(tables), out / "paper-load")
    pngs |= {name: at_load[name] for name in ("latency", "heatmaps", "stickiness")}
    pngs["guard"] = write_guard_png(result.guard, out / "guard.png")
    pngs["sensitivity"] = write_sensitivity_png(result.sensitivity, out / "sensitivity.png")
    return pngs


def _tier_sections(result: ReproduceResult) -> list[Section]:
    ours = [p for p in result.policies if is_ours(p)]
    knees = tier_knees(result)
    head = ("policy", *(f"global {t}" for t in result.tiers))
    split = [
        [p]
        + [
            " / ".join(pct(share) for share in _split(cell.policies[p].reuse))
            for cell in result.tiers.values()
        ]
        for p in result.policies
    ]
    return [
        Section(
            "Max TPS within SLO per global tier (Figs. 11a, 16a)",
            "Each policy's knee: its load (sessions/s) searched adaptively until its TPS "
            "within SLO (prompt + output tokens/s of requests meeting both SLOs) peaks; "
            "mean (± standard deviation, with several seeds) at the knee, best per tier in "
            "bold, then each of the project's policies against the best baseline at its best "
            "setting.",
            ("max_tps", "knee"),
            head,
            knee_rows(knees, ours, kilo, lambda text: f"**{text}**") + ceiling_rows(result),
        ),
        Section(
            "Where prompt tokens came from at each knee (Figs. 11b, 16b)",
            "Local-tier hits / global-tier hits / misses (recomputed), share of prompt "
            "tokens, mean over seeds, at the knee of the table above.",
            ("reuse_by_provisioning",),
            head,
            split,
        ),
    ]


def _split(reuse: HitSplit) -> tuple[float, float, float]:
    """Local hits, global hits and misses, the order the tables and figures show them."""
    return reuse.local, reuse.global_, reuse.miss


def ceiling_rows(result: ReproduceResult) -> list[list[str]]:
    """The knee table's ceiling, where the evaluation searched one: the best knee of any
    policy with a free global tier (never evicts, moves KV in no time), and the best
    policy of each tier as a share of it (none without a ceiling)."""
    ceiling = result.ceiling
    if ceiling is None:
        return []
    top = ceiling.knees[ceiling.best]
    columns = len(result.tiers)
    shares = []
    for cell in result.tiers.values():
        best = max(cell.policies, key=lambda p: cell.policies[p].knee.mean)
        share = cell.policies[best].knee.mean / top.mean if top.mean else 0
        shares.append(f"{share:.0%} ({best})")
    return [
        [f"ceiling: free global tier, best of all ({ceiling.best})"]
        + [f"{kilo(top.mean)} (@{top.load:.3g})"] * columns,
        ["best policy / ceiling", *shares],
    ]


def _rate_section(result: ReproduceResult) -> Section:
    sweep, unit = result.rate_sweep, result.load_unit
    head = (
        "policy",
        *(f"{m:g}x ({r:.3g}/s)" for m, r in zip(sweep.multiples, sweep.rates, strict=True)),
    )
    tops = [
        max(points[i].tps_within_slo for points in sweep.policies.values())
        for i in range(len(sweep.rates))
    ]
    rows = [
        [p]
        + [
            f"**{kilo(point.tps_within_slo)}**"
            if point.tps_within_slo == top
            else kilo(point.tps_within_slo)
            for point, top in zip(points, tops, strict=True)
        ]
        for p, points in sweep.policies.items()
    ]
    return Section(
        "TPS within SLO vs offered load, full global tier (Fig. 15a)",
        f"Mean over seeds. The load unit 1.0x is {unit.rate:.4g} sessions/s: two thirds "
        f"of the best baseline's knee on the full tier ({unit.reference_policy} at "
        f"{unit.reference_knee:.4g}/s), so that {unit.paper_load:g}x, where the paper "
        "measures Figs. 14, 17 and 25 near saturation, is that knee.",
        ("tps_vs_rate",),
        head,
        rows,
    )


def _paper_load_section(result: ReproduceResult) -> Section:
    at = result.at_paper_load
    rows = []
    for p, v in at.policies.items():
        ttft, tpot, sticky, reuse = v.ttft_s, v.tpot_s, v.stickiness, v.reuse
        rows.append(
            [
                p,
                kilo(v.tps_within_slo),
                pct(v.slo_attainment),
                " / ".join(seconds(ttft.of(q)) for q in QUANTILES),
                " / ".join(_ms(tpot.of(q)) for q in QUANTILES),
                f"{pct(reuse.local)} / {pct(reuse.global_)}",
                times(v.imbalance),
                " / ".join(pct(sticky.of(way)) for way in WAYS),
            ]
        )
    return Section(
        f"At {result.load_unit.paper_load:g}x load, full global tier: latency, balance, "
        "stickiness (Figs. 12, 15b, 17)",
        f"{at.rate:.4g} sessions/s; means over seeds, figures from the first seed; "
        "imbalance: mean max / mean in-flight tokens per window after the warm-up. Latency "
        "counts every completed request, met SLO or not, as the paper does. Stickiness: "
        "follow-ups on the instance of their session's first request / of their own "
        "conversation's first request (a sub-agent is its own) / of their previous turn.",
        ("latency", "heatmaps", "stickiness"),
        (
            "policy",
            "TPS@SLO",
            "SLO met",
            "TTFT p50 / p90 / p99",
            "TPOT ms p50 / p90 / p99",
            "hits local / global",
            "imbalance",
            "sticky session / agent / turn",
        ),
        rows,
    )


def _guard_section(result: ReproduceResult) -> Section:
    rows = []
    for spec, data in result.guard.items():
        q = data.percentiles
        rows.append(
            [spec, kilo(data.tps_within_slo), times(data.mean)]
            + [times(q[k]) for k in ("p50", "p75", "p90", "p99")]
        )
    return Section(
        "SMetric's overload guard on and off (Fig. 14)",
        f"`smetric` (OVERLOAD=2) against `{GUARD_OFF}` (the guard never trips), full tier, "
        f"{result.load_unit.paper_load:g}x load: per-window imbalance (max / mean "
        "in-flight tokens per window, over every seed's busy windows after the warm-up).",
        ("guard",),
        ("policy", "TPS@SLO", "mean", "p50", "p75", "p90", "p99"),
        rows,
    )


def _sensitivity_section(result: ReproduceResult) -> Section:
    rows = []
    for param, points in result.sensitivity.items():
        default = next((p for p in points if p.policy == "smetric"), None)
        for point in points:
            lead = "-"
            if default and default.tps_within_slo:
                lead = f"{(point.tps_within_slo / default.tps_within_slo - 1) * 100:+.1f} %"
            reuse = point.reuse
            rows.append(
                [
                    param.upper(),
                    point.label,
                    kilo(point.tps_within_slo),
                    lead,
                    f"{pct(reuse.local)} / {pct(reuse.global_)}",
                    pct(reuse.local + reuse.global_),
                ]
            )
    return Section(
        "Sensitivity to OVERLOAD and HIT_RATIO (Fig. 25)",
        f"`smetric:overload=X` and `smetric:hit_ratio=Y` (defaults 2 and 0.5), full tier, "
        f"{result.load_unit.paper_load:g}x load, mean over seeds.",
        ("sensitivity",),
        ("parameter", "value", "TPS@SLO", "vs default", "hits local / global", "overall hits"),
        rows,
    )


def _paper_section(result: ReproduceResult) -> Section:
    return Section(
        "The paper's numbers beside ours",
        "The paper measured 32 H20s running vLLM with Mooncake and LMCache on its "
        "production trace; ours come from the simulator on the setup above, so compare "
        "directions and rough sizes, not digits. Bailian is `linear` (λ=0.9), "
        "load-balance-only is `least_load`.",
        (),
        ("fig.", "what", "paper", "ours"),
        [list(row) for row in comparisons(result)],
    )


SECTIONS: tuple[Callable[[ReproduceResult], Section | list[Section]], ...] = (
    _paper_section,
    _tier_sections,
    _rate_section,
    _paper_load_section,
    _guard_section,
    _sensitivity_section,
)


def sections(result: ReproduceResult) -> list[Section]:
    out: list[Section] = []
    for build in SECTIONS:
        made = build(result)
        out.extend(made if isinstance(made, list) else [made])
    return out


def intro(result: ReproduceResult, command: str) -> str:
    slo = result.config["slo"]
    return (
        f"Generated by `{command}` (preset `{result.preset}`, trace "
        f"`{result.trace}`): {result.setup}. Global-tier loads "
        f"{result.config['cluster']['kv_load']}; SLOs: TTFT ≤ {slo['ttft_base_s']:g} s + "
        f"{slo['ttft_per_token_s'] * 1000:g} ms per prompt token, TPOT ≤ "
        f"{slo['tpot_s'] * 1000:g} ms. Policies: {', '.join(f'`{p}`' for p in result.policies)}."
    )


def validation_markdown(result: ReproduceResult, command: str) -> str:
    parts = [intro(result, command) + "\n"]
    for section in sections(result):
        parts.append(f"### {section.title}\n\n{section.caption}\n")
        parts.append(markdown_table(section.head, section.rows))
    return "\n".join(parts)


def _data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def inline(text: str) -> Markup:
    """The Markdown the tables use (``**bold**``, ```code```) as HTML, the rest escaped."""
    html = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", str(escape(text)))
    return Markup(re.sub(r"`(.+?)`", r"<code>\1</code>", html))


def write_html(result: ReproduceResult, pngs: Mapping[str, Path], command: str, path: Path) -> None:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("smetric.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["inline"] = inline
    page = env.get_template("reproduce.html.j2").render(
        intro=intro(result, command),
        sections=sections(result),
        images={name: _data_uri(png) for name, png in pngs.items()},
    )
    path.write_text(page, encoding="utf-8")


def write_report(
    result: ReproduceResult,
    summaries: Mapping[str, RunSummary],
    tables: Mapping[str, pl.DataFrame],
    command: str,
    out: Path,
) -> tuple[Path, Path]:
    """``report.html`` (figures embedded) and ``validation.md`` in ``out``."""
    pngs = write_figures(result, summaries, tables, out)
    html, markdown = out / "report.html", out / "validation.md"
    write_html(result, pngs, command, html)
    markdown.write_text(validation_markdown(result, command))
    return html, markdown
