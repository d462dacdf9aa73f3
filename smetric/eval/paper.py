"""The paper's published colocation numbers (§4.1, §4.2, §5.2, §5.4, §5.5) beside ours,
and those of its larger-model evaluation (Figures 18-20) for a Qwen3-235B result.

Each row names the figure, what the paper states, and the same quantity computed from a
``reproduce`` result; a row whose policies were not run says so instead of a number. The
paper's "Bailian" is ``linear`` at λ=0.9, its "load-balance-only" is ``least_load``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from smetric.core.policies import is_ours
from smetric.eval.reproduce import GUARD_OFF, PAPER_LOAD
from smetric.metrics.results import Point, Quantile, ReproduceResult
from smetric.sim.knee import best_baseline

BAILIAN = "linear"
LOAD_BALANCE = "least_load"
LMETRIC = "lmetric"


class Comparison(NamedTuple):
    figure: str
    claim: str
    paper: str
    ours: str


def pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f} %"


def change(ours: float | None, theirs: float | None) -> str:
    if ours is None or not theirs:
        return "-"
    return f"{(ours / theirs - 1) * 100:+.1f} %"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _knee(result: ReproduceResult, tier: str, policy: str) -> float:
    return result.tiers[tier].policies[policy].knee.mean


def _vs_best_baseline(result: ReproduceResult, policy: str, tiers: Sequence[str]) -> str:
    parts = []
    for tier in tiers:
        rival = result.tiers[tier].best_baseline
        if rival is None:
            return "-"
        gap = change(_knee(result, tier, policy), _knee(result, tier, rival))
        parts.append(f"{tier}: {gap} vs {rival}")
    return "; ".join(parts)


def _needs(result: ReproduceResult, *policies: str) -> str | None:
    """Why a row cannot be computed: the policies it compares that were not run."""
    missing = [p for p in policies if p not in result.policies]
    return f"not run (needs {', '.join(missing)})" if missing else None


def _with_store(result: ReproduceResult) -> list[Comparison]:
    tiers = [t for t in result.tiers if t != "none"]
    return [
        Comparison(
            "16a",
            f"`{p}` vs the best baseline, with a global store ({', '.join(tiers)})",
            "+10 % to +16 %",
            _vs_best_baseline(result, p, tiers),
        )
        for p in result.policies
        if is_ours(p)
    ]


def _no_store(result: ReproduceResult) -> list[Comparison]:
    if "none" not in result.tiers:
        return []
    ours = _needs(result, "smetric", BAILIAN) or change(
        _knee(result, "none", "smetric"), _knee(result, "none", BAILIAN)
    )
    return [Comparison("16a", "No global store: `smetric` vs Bailian", "within 1 % (ahead)", ours)]


def _load_balance_gap(result: ReproduceResult) -> list[Comparison]:
    full = result.tiers["full"].policies
    others = {p: v.knee.mean for p, v in full.items() if p != LOAD_BALANCE}
    rival = best_baseline(others)
    ours = _needs(result, LOAD_BALANCE) or (
        "-"
        if rival is None
        else f"{change(full[LOAD_BALANCE].knee.mean, others[rival])} vs {rival}"
    )
    return [
        Comparison("11a", "Full tier: least-load vs the strongest baseline", "within 7 %", ours)
    ]


def _reuse(result: ReproduceResult) -> list[Comparison]:
    full = result.tiers["full"].policies
    overall = [v.reuse.local + v.reuse.global_ for v in full.values()]
    rows = [
        Comparison(
            "11b",
            "Full tier: overall reuse (local + global hits) over all policies",
            "73-75 %",
            f"{pct(min(overall))} to {pct(max(overall))}",
        ),
        Comparison(
            "16b",
            "Full tier: local-tier hits, `smetric` vs Bailian",
            "64 % vs 65 %",
            _needs(result, "smetric", BAILIAN)
            or f"{pct(full['smetric'].reuse.local)} vs {pct(full[BAILIAN].reuse.local)}",
        ),
    ]
    small = [t for t in result.tiers if t not in ("none", "full")] or ["none"]
    at = result.tiers[small[0]].policies
    trio = (BAILIAN, LMETRIC, LOAD_BALANCE)
    rows.append(
        Comparison(
            "11b",
            f"No or a small global tier (ours: {small[0]}): local-tier hits, "
            "Bailian / LMetric / least-load",
            "58 % / 33 % / 6 %",
            _needs(result, *trio) or " / ".join(pct(at[p].reuse.local) for p in trio),
        )
    )
    return rows


def _balance(result: ReproduceResult) -> list[Comparison]:
    at = result.at_paper_load.policies
    four = ("smetric", BAILIAN, LMETRIC, LOAD_BALANCE)
    pair = (BAILIAN, LOAD_BALANCE)
    sticky = _needs(result, *pair) or " vs ".join(
        f"{pct(at[p].stickiness.session)} (per agent {pct(at[p].stickiness.agent)})" for p in pair
    )
    return [
        Comparison(
            "15b",
            f"Full tier, {PAPER_LOAD:g}x load: mean imbalance (max/mean in-flight tokens), "
            "`smetric` / Bailian / LMetric / least-load",
            "2.6x / 3.0x / 3.2x / 2.0x",
            _needs(result, *four) or " / ".join(times(at[p].imbalance) for p in four),
        ),
        Comparison(
            "12",
            f"Full tier, {PAPER_LOAD:g}x load: follow-ups on their session's first "
            "instance, Bailian vs least-load",
            "96.6 % vs 4.0 %",
            sticky,
        ),
    ]


def _rate_sweep(result: ReproduceResult) -> list[Comparison]:
    sweep = result.rate_sweep
    if "smetric" not in sweep.policies:
        return []
    tps = {p: [point.tps_within_slo for point in v] for p, v in sweep.policies.items()}
    parts = []
    for multiple in (1.0, 1.5, 1.75):
        if multiple not in sweep.multiples:
            continue
        i = sweep.multiples.index(multiple)
        rival = best_baseline({p: v[i] for p, v in tps.items()})
        if rival is not None:
            parts.append(f"{multiple:g}x: {change(tps['smetric'][i], tps[rival][i])} vs {rival}")
    rows = [
        Comparison(
            "15a",
            "Full tier: `smetric` vs the strongest baseline at 1.0x / 1.5x / 1.75x load",
            "within 1 % / +15 % / +4 %",
            "; ".join(parts) or "-",
        )
    ]
    if 2.0 in sweep.multiples:
        i = sweep.multiples.index(2.0)
        below = sum(1 for v in tps.values() if v[i] < max(v))
        rows.append(
            Comparison(
                "15a",
                "Full tier, 2.0x load: policies below their peak TPS within SLO",
                "all",
                f"{below} of {len(tps)}",
            )
        )
    return rows


def _latency(result: ReproduceResult) -> list[Comparison]:
    at = result.at_paper_load.policies
    missing = _needs(result, "smetric", BAILIAN)
    rivals = [p for p in at if not is_ours(p)]
    tpot = [_tpot_vs_best(at, rivals, "p50"), _tpot_vs_best(at, rivals, "p90")]
    ttft = missing or (
        f"{seconds(at['smetric'].ttft_s.p50)}, "
        f"{change(at['smetric'].ttft_s.p50, at[BAILIAN].ttft_s.p50)} vs Bailian"
    )
    return [
        Comparison(
            "17",
            f"Full tier, {PAPER_LOAD:g}x load: `smetric`'s median TTFT",
            "1.1 s, -17 % vs Bailian",
            ttft,
        ),
        Comparison(
            "17",
            f"Full tier, {PAPER_LOAD:g}x load: `smetric`'s TPOT vs the best baseline at "
            "each percentile",
            "P50 -10 %, P90 -20 %",
            _needs(result, "smetric") or ", ".join(tpot),
        ),
    ]


def _tpot_vs_best(at: Mapping[str, Point], rivals: Sequence[str], q: Quantile) -> str:
    """``smetric``'s TPOT at percentile ``q`` against the best of ``rivals`` there."""
    best = min((v for v in (at[p].tpot_s.of(q) for p in rivals) if v), default=None)
    mine = at["smetric"].tpot_s.of(q) if "smetric" in at else None
    return f"{q.upper()} {change(mine, best)}"


def _guard(result: ReproduceResult) -> list[Comparison]:
    on, off = result.guard["smetric"].percentiles, result.guard[GUARD_OFF].percentiles
    ours = ", ".join(f"{q} {times(on[q])} vs {times(off[q])}" for q in ("p75", "p90", "p99"))
    return [
        Comparison(
            "14",
            "Overload guard on vs off (OVERLOAD=∞): per-window imbalance",
            "lower beyond the p75 of windows (figure only)",
            ours,
        )
    ]


def _sensitivity(result: ReproduceResult) -> list[Comparison]:
    rows = []
    for param, label, paper in (
        ("overload", "OVERLOAD", "within 6 % of the default; overall hits 75-76 %"),
        ("hit_ratio", "HIT_RATIO", "within 4 % of the default; overall hits 75-76 %"),
    ):
        points = result.sensitivity[param]
        default = next((p for p in points if p.policy == "smetric"), None)
        if default is None:
            continue
        worst = max(
            abs(p.tps_within_slo / default.tps_within_slo - 1)
            for p in points
            if default.tps_within_slo
        )
        hits = [p.reuse.local + p.reuse.global_ for p in points]
        span = f"{points[0].label} to {points[-1].label}"
        rows.append(
            Comparison(
                "25",
                f"{label} {span}: `smetric`'s TPS within SLO and overall hits",
                paper,
                f"within {worst * 100:.1f} % of the default; overall hits "
                f"{pct(min(hits))} to {pct(max(hits))}",
            )
        )
    return rows


SECTIONS: tuple[Callable[[ReproduceResult], list[Comparison]], ...] = (
    _with_store,
    _no_store,
    _load_balance_gap,
    _reuse,
    _rate_sweep,
    _balance,
    _latency,
    _guard,
    _sensitivity,
)


def is_large_model(result: ReproduceResult) -> bool:
    """A result of the paper's larger model (Qwen3-235B-A22B), whose evaluation is its
    Figures 18-20 rather than the 30B model's."""
    return "235B" in result.config["cluster"]["model"]


def title(result: ReproduceResult) -> str:
    if is_large_model(result):
        return "The paper's larger model: Qwen3-235B-A22B-FP8 on 8 x 4 H20 (Figs. 18-20)"
    return "The paper's colocation evaluation"


def _peak(result: ReproduceResult) -> list[Comparison]:
    sweep = result.rate_sweep
    missing = _needs(result, "smetric", BAILIAN)
    rows = [
        Comparison(
            "18a",
            "Full tier: `smetric`'s peak TPS within SLO vs Bailian's peak over the sweep",
            "+8 %",
            missing or change(_knee(result, "full", "smetric"), _knee(result, "full", BAILIAN)),
        )
    ]
    at_peak = "-"
    if not _needs(result, "smetric", LMETRIC):
        points = sweep.policies["smetric"]
        i = max(range(len(points)), key=lambda j: points[j].tps_within_slo)
        ours, theirs = points[i], sweep.policies[LMETRIC][i]
        at_peak = (
            f"{change(ours.tps_within_slo, theirs.tps_within_slo)} "
            f"(at {sweep.multiples[i]:g}x, `smetric`'s best sweep point)"
        )
    rows.append(
        Comparison(
            "18a",
            "Full tier: `smetric` vs LMetric at `smetric`'s peak operating point",
            "+20 %",
            at_peak,
        )
    )
    return rows


def _large_balance(result: ReproduceResult) -> list[Comparison]:
    at = result.at_paper_load.policies
    four = ("smetric", LMETRIC, BAILIAN, LOAD_BALANCE)
    gap = _needs(result, "smetric", LOAD_BALANCE) or change(
        at[LOAD_BALANCE].tps_within_slo, at["smetric"].tps_within_slo
    )
    return [
        Comparison(
            "18b",
            f"Full tier, {PAPER_LOAD:g}x load: mean imbalance, `smetric` / LMetric / Bailian "
            "/ least-load",
            "1.6x / 1.6x / 1.6x / 1.3x",
            _needs(result, *four) or " / ".join(times(at[p].imbalance) for p in four),
        ),
        Comparison(
            "18b",
            f"Full tier, {PAPER_LOAD:g}x load: least-load's TPS within SLO vs `smetric`'s",
            "-32 %",
            gap,
        ),
    ]


def _large_reuse(result: ReproduceResult) -> list[Comparison]:
    full = result.tiers["full"].policies
    if "smetric" not in full:
        return [Comparison("19b", "Full tier: `smetric`'s local and overall reuse", "", "-")]
    mine = full["smetric"].reuse
    overall = {p: v.reuse.local + v.reuse.global_ for p, v in full.items()}
    best = max(overall, key=overall.__getitem__)
    return [
        Comparison(
            "19b",
            "Full tier, at each knee: `smetric`'s local-tier hits and overall reuse "
            "(the highest of all policies)",
            "69 % and 76 % (highest)",
            f"{pct(mine.local)} and {pct(overall['smetric'])} (highest: {best})",
        )
    ]


def _large_latency(result: ReproduceResult) -> list[Comparison]:
    at = result.at_paper_load.policies
    missing = _needs(result, "smetric", LMETRIC)

    def ttft(q: Quantile) -> str:
        if missing:
            return missing
        mine = at["smetric"].ttft_s.of(q)
        return f"{seconds(mine)}, {change(mine, at[LMETRIC].ttft_s.of(q))} vs LMetric"

    rivals = [p for p in at if not is_ours(p)]
    tpot = [_tpot_vs_best(at, rivals, "p90"), _tpot_vs_best(at, rivals, "p99")]
    return [
        Comparison(
            "20",
            f"Full tier, {PAPER_LOAD:g}x load: `smetric`'s median TTFT",
            "0.85 s, -24 % vs LMetric",
            ttft("p50"),
        ),
        Comparison(
            "20",
            f"Full tier, {PAPER_LOAD:g}x load: `smetric`'s P90 TTFT",
            "7.7 s, -26 % vs LMetric",
            ttft("p90"),
        ),
        Comparison(
            "20",
            f"Full tier, {PAPER_LOAD:g}x load: `smetric`'s TPOT vs the best baseline at P90 / P99",
            "-13 % / -34 %",
            _needs(result, "smetric") or ", ".join(tpot),
        ),
    ]


LARGE_SECTIONS: tuple[Callable[[ReproduceResult], list[Comparison]], ...] = (
    _peak,
    _large_balance,
    _large_reuse,
    _large_latency,
)


def comparisons(result: ReproduceResult) -> list[Comparison]:
    """Every published number the result can be set beside, in the paper's order."""
    sections = LARGE_SECTIONS if is_large_model(result) else SECTIONS
    return [row for section in sections for row in section(result)]
