"""``smetric grid``'s result as Markdown: one row per cell, the verdict under each table."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

from smetric.core.policies import DEFAULT_POLICY, is_ours
from smetric.eval.grid import (
    AHEAD,
    FREE_TIER,
    FREE_TWIN,
    WITHIN,
    cell_verdict,
    is_ceiling,
    means_of,
    twin_of,
    verdict_summary,
)
from smetric.metrics.results import GridCell, GridResult, Knee, Which
from smetric.report.markdown import markdown_table


def _k(value: float) -> str:
    return f"{value / 1000:,.1f}k"


def _knee(knee: Knee) -> str:
    spread = f" ± {_k(knee.stdev)}" if len(knee.seeds) > 1 else ""
    return f"{_k(knee.mean)}{spread} (@{knee.load:.3g})"


def cell_name(cell: GridCell, worlds: bool = False) -> str:
    """trace · tier · fetch · hardware, and the world where a grid has several."""
    fields = [cell.trace, cell.tier, cell.kv_load, cell.hardware]
    return " · ".join(fields + ([cell.world] if worlds else []))


def grid_table(result: GridResult, which: Which = "knees") -> str:
    """Cells as rows (trace · tier · fetch · hardware · world): the best baseline (name,
    knee), then each of our policies' knee and its lead over that baseline; with
    ceiling cells, each ceiling and the best policy's share of it."""
    ours = [p for p in result.policies if is_ours(p)]
    ceilings = ceiling_of(result, which)
    own = own_ceiling_of(result, which)
    worlds = len(result.worlds) > 1
    head = [
        "cell",
        "best baseline",
        *ours,
        *(["ceiling: own tier, free"] if own else []),
        *(["ceiling (best of all)"] if ceilings else []),
    ]
    rows = []
    for cell in measured_cells(result):
        means = means_of(cell, which)
        verdict = cell_verdict(means)
        rival = verdict.best_baseline
        row = [
            cell_name(cell, worlds),
            f"{rival} {_knee(cell.of(which)[rival])}" if rival else "-",
        ]
        for p in ours:
            lead = verdict.lead[p]
            text = _knee(cell.of(which)[p])
            row.append(f"{text}, {lead:+.1f} %" if lead is not None else text)
        best = max(means.values())
        tops = [own.get(own_key(cell))] if own else []
        tops += [ceilings.get(group_of(cell))] if ceilings else []
        row += [f"{_k(top)}, best {best / top:.0%}" if top else "-" for top in tops]
        rows.append(row)
    return markdown_table(head, rows).rstrip("\n")


def verdict_line(cells: Sequence[Mapping[str, float]]) -> str:
    """Per policy of ours: in how many cells it is within 1 % of the best baseline and in
    how many at least 5 % ahead."""
    parts = [
        f"`{p}` within {-WITHIN:g} % of the best baseline (or ahead) in {s['within_1pct']} "
        f"of {s['cells']} cells, at least {AHEAD:g} % ahead in {s['ahead_5pct']}"
        for p, s in verdict_summary(cells).items()
    ]
    return "Verdict: " + "; ".join(parts) + "."


def headroom_line(result: GridResult, which: Which = "knees") -> str | None:
    """Where the ceiling leaves room for a lead of ``AHEAD`` % over the best baseline, and
    how many of those cells each of our policies wins by that much. In a cell where even
    a free global tier under the best policy is less than that above the best baseline,
    a routing rule can hardly win by it (up to the knee search's precision); counting
    wins only where one could separates a rule that falls short from a cell with little
    left to win. With the tiers' free twins, the same count against each cell's own tier
    made free, the tighter ceiling: the room the free-tier ceiling shows beyond it is
    capacity, which no router recovers (None without ceilings)."""
    ceilings = ceiling_of(result, which)
    own = own_ceiling_of(result, which)
    if not ceilings and not own:
        return None
    cells = measured_cells(result)
    parts = []
    if ceilings:
        room, wins = _room(result, cells, group_of, ceilings, which)
        parts.append(
            f"Headroom: in {room} of {len(cells)} cells the free-tier ceiling is at least "
            f"{AHEAD:g} % above the best baseline, so a lead of {AHEAD:g} % is possible "
            f"there; at least {AHEAD:g} % ahead in those: {wins}. In the other cells even "
            "a free global tier under the best policy gains less than that."
        )
    if own:
        tiered = [c for c in cells if own_key(c) in own]
        room, wins = _room(result, tiered, own_key, own, which)
        parts.append(
            "With each cell's own tier made free (the same capacity, its transfers costing "
            f"nothing: an estimate of the most any router could reach with it), {room} of the "
            f"{len(tiered)} cells with a global tier leave room for a lead of {AHEAD:g} %; "
            f"at least {AHEAD:g} % ahead in those: {wins}."
        )
    return " ".join(parts)


def _room(
    result: GridResult,
    cells: Sequence[GridCell],
    key: Callable[[GridCell], tuple],
    ceilings: Mapping[tuple, float],
    which: Which,
) -> tuple[int, str]:
    """How many ``cells`` have a ceiling (``ceilings[key(cell)]``) at least ``AHEAD`` %
    above their best baseline, and, as text, how many of those each of our policies wins
    by that much."""
    room, wins = 0, dict.fromkeys([p for p in result.policies if is_ours(p)], 0)
    for cell in cells:
        verdict = cell_verdict(means_of(cell, which))
        top = ceilings.get(key(cell))
        if not top or not verdict.value or top < verdict.value * (1 + AHEAD / 100):
            continue
        room += 1
        for p, lead in verdict.lead.items():
            wins[p] += int(lead is not None and lead >= AHEAD - 1e-9)
    return room, ", ".join(f"`{p}` in {n}" for p, n in wins.items())


def measured_cells(result: GridResult) -> list[GridCell]:
    """The cells the verdict counts: all but the ceilings."""
    return [c for c in result.cells if not is_ceiling(c.tier)]


def group_of(cell: GridCell) -> tuple:
    """The cells one ceiling bounds: all tiers of a trace, fetch mode, KV room, world."""
    return (cell.trace, cell.kv_load, cell.hardware, cell.world)


def own_key(cell: GridCell) -> tuple:
    """A cell's group and its tier's free twin: where its own-tier ceiling is found."""
    return (*group_of(cell), twin_of(cell.tier))


def ceiling_of(result: GridResult, which: Which = "knees") -> dict[tuple, float]:
    """Per group, the best knee any policy reached with a free global tier."""
    return {
        group_of(c): max(means_of(c, which).values()) for c in result.cells if c.tier == FREE_TIER
    }


def own_ceiling_of(result: GridResult, which: Which = "knees") -> dict[tuple, float]:
    """Per group and twin tier, the best knee any policy reached with that tier free: the
    own-tier ceiling of the cells of that tier (``full``'s twin is the free tier itself).
    Empty unless the grid ran the tiers' twins."""
    if not any(c.tier.startswith(FREE_TWIN) for c in result.cells):
        return {}
    return {
        (*group_of(c), c.tier): max(means_of(c, which).values())
        for c in result.cells
        if is_ceiling(c.tier)
    }


def default_policy(result: GridResult) -> str | None:
    """The policy whose lead the robustness table follows: the default, else the first
    of ours."""
    ours = [p for p in result.policies if is_ours(p)]
    return DEFAULT_POLICY if DEFAULT_POLICY in ours else (ours[0] if ours else None)


def seed_leads(cell: GridCell, policy: str, which: Which = "knees") -> list[float]:
    """``policy``'s lead over the cell's best baseline (by mean), seed by seed, in %."""
    rival = cell_verdict(means_of(cell, which)).best_baseline
    if rival is None:
        return []
    knees = cell.of(which)
    ours, theirs = knees[policy].seeds, knees[rival].seeds
    return [(a / b - 1) * 100 for a, b in zip(ours, theirs, strict=True) if b > 0]


def robustness_table(result: GridResult, which: Which = "knees") -> str:
    """Worlds as rows, cells (trace · tier · fetch · hardware) as columns: the default
    policy's lead over the best baseline, mean ± standard deviation over seeds."""
    policy = default_policy(result)
    cells = measured_cells(result)
    columns = list(dict.fromkeys(cell_name(c) for c in cells))
    by_world: dict[str, dict[str, str]] = {}
    for cell in cells:
        leads = seed_leads(cell, policy, which) if policy else []
        if not leads:
            text = "-"
        elif len(leads) > 1:
            text = f"{statistics.fmean(leads):+.1f} ± {statistics.stdev(leads):.1f} %"
        else:
            text = f"{leads[0]:+.1f} %"
        by_world.setdefault(cell.world, {})[cell_name(cell)] = text
    rows = [[world, *(row.get(c, "-") for c in columns)] for world, row in by_world.items()]
    return markdown_table(["world", *columns], rows).rstrip("\n")


def _world_line(name: str, factors: Mapping[str, float]) -> str:
    changed = [f"{k} {v:.3g}" for k, v in factors.items() if v != 1]
    return f"- `{name}`: " + (", ".join(changed) if changed else "as configured")


def grid_markdown(result: GridResult, command: str) -> str:
    """The grid under the default SLO and under the looser one, each with its verdict."""
    loose, slo = result.loose_slo, result.slo
    seeds = result.seeds
    out = [
        f"Generated by `{command}` (preset `{result.preset}`): each policy's knee (max "
        f"TPS within SLO, tok/s, searched adaptively over load to {result.precision:g}x; "
        f"sessions/s closed loop, replay speed-up open loop) per cell, mean"
        f"{' ± standard deviation' if seeds > 1 else ''} over {seeds} seed"
        f"{'s' if seeds > 1 else ''}; the best baseline at its best setting, and each of "
        "the project's policies with its lead over it.",
        "",
        f"#### Default SLO ({_slo(slo)})",
        "",
        grid_table(result),
        "",
        verdict_line([means_of(c) for c in measured_cells(result)]),
        "",
        *_headroom_part(result),
        *_robustness_part(result),
        f"#### Looser SLO ({_slo(loose)})",
        "",
        "The same runs scored again (the SLO never changes what the simulator does); each "
        "knee is the best of the loads probed for the default SLO.",
        "",
        grid_table(result, "loose"),
        "",
        verdict_line([means_of(c, "loose") for c in measured_cells(result)]),
        *_headroom_part(result, "loose"),
    ]
    return "\n".join(out).rstrip("\n") + "\n"


def _headroom_part(result: GridResult, which: Which = "knees") -> list[str]:
    line = headroom_line(result, which)
    return [] if line is None else [line, ""]


def _robustness_part(result: GridResult) -> list[str]:
    """Under the default SLO: how each world differs, and the default policy's lead in
    each (nothing for a grid of one world)."""
    worlds = result.worlds
    if len(worlds) < 2:
        return []
    policy = default_policy(result)
    return [
        f"#### `{policy}`'s lead in every world",
        "",
        "The same cells with the simulated engines changed behind the policies' backs: "
        "what the policies are told of the hardware (their derived constants) stays as "
        "configured, so a policy that learns its prices must find the change itself.",
        "",
        *(_world_line(name, factors) for name, factors in worlds.items()),
        "",
        f"Lead of `{policy}` over the cell's best baseline (by mean), per seed at each "
        "policy's knee, mean ± standard deviation over seeds:",
        "",
        robustness_table(result),
        "",
    ]


def _slo(slo: Mapping[str, float]) -> str:
    return (
        f"TTFT {slo['ttft_base_s']:g} s + {slo['ttft_per_token_s'] * 1000:g} ms/token, "
        f"TPOT {slo['tpot_s'] * 1000:g} ms"
    )
