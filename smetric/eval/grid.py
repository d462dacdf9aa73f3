"""The policy grid: every policy's knee in every cell, and the verdict.

A cell is a trace, a global tier, a fetch mode (``kv_load``) and a KV room (hardware and
KV dtype). Each (cell, policy) pair is its own knee search whose first load depends only
on the cell, so its probes, and hence its runs in the ``RunStore``, do not depend on which
other policies ran: adding a policy later runs only that policy's probes. Every probe is
stored with its per-request table, so the looser SLO scores the same runs again (the SLO
never changes what the simulator does); its knee is the best of the loads probed for the
default SLO.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from smetric.core.policies import is_ours
from smetric.eval.grid_preset import GridPreset
from smetric.metrics.results import GridCell, GridResult, Knee, Which
from smetric.metrics.slo import SLOConfig
from smetric.metrics.summary import tps_under_slo
from smetric.sim.config import SimConfig
from smetric.sim.knee import KneeSettings, best_baseline, knee_of, probe_job, search_knees
from smetric.sim.parallel import RunStore
from smetric.trace.schema import Trace

# The tier of a cell that gives its group a ceiling: the same cluster with a free global
# tier (never evicts, moves KV in no time), under every policy, the best of them.
FREE_TIER = "free"
FREE_GLOBAL_TIER = {
    "global_capacity": "full",
    "global_medium": "line-rate",
    "tier_bandwidth_scale": math.inf,
}
# Each bounded tier's own ceiling: the same capacity, its transfers costing nothing. A
# router cannot make the wire free, and with a free wire a request keeps the reuse the
# tier holds wherever it goes, so the best knee there estimates the most any router could
# reach with that tier (to the knee search's precision); what ``FREE_TIER`` adds above
# it is capacity, which no routing recovers.
FREE_TWIN = "free-"
FREE_TRANSFERS = {"global_medium": "line-rate", "tier_bandwidth_scale": math.inf}
# The verdict's thresholds: within 1 % of the best baseline (a tie), at least 5 % ahead (a win).
WITHIN, AHEAD = -1.0, 5.0

# Loads the trace a configuration names (once per trace of the preset).
TraceLoader = Callable[[SimConfig], Trace]


def is_ceiling(tier: str) -> bool:
    """Whether a cell's tier is a ceiling (``FREE_TIER`` or a tier's free twin)."""
    return tier == FREE_TIER or tier.startswith(FREE_TWIN)


def twin_of(tier: str) -> str | None:
    """The ceiling cell that bounds a tier's cell with that tier's own capacity: none
    without a tier (nothing moves), ``FREE_TIER`` for ``full`` (it never evicts)."""
    if tier == "none":
        return None
    return FREE_TIER if tier == "full" else FREE_TWIN + tier


def _tier_settings(tier: str) -> dict:
    """The cluster settings of a cell's tier, ceilings included."""
    if tier == FREE_TIER:
        return FREE_GLOBAL_TIER
    if tier.startswith(FREE_TWIN):
        return {"global_capacity": tier.removeprefix(FREE_TWIN), **FREE_TRANSFERS}
    return {"global_capacity": tier}


def grid_cells(preset: GridPreset) -> dict[tuple, tuple[SimConfig, float]]:
    """Per cell ``(trace, tier, kv_load, hardware, world)``: its configuration and first
    load. With ``preset.ceiling``, each (trace, kv_load, hardware, world) has one more
    cell, tier ``free``, started at the highest tier's first load; with
    ``preset.tier_ceilings``, each tier but ``none`` and ``full`` has its free twin,
    started at that tier's first load."""
    cells = {}
    for name, trace in preset.traces.items():
        tiers = dict(trace.tiers)
        if preset.ceiling:
            tiers[FREE_TIER] = max(trace.tiers.values())
        if preset.tier_ceilings:
            twins = {twin_of(t): v for t, v in trace.tiers.items()}
            tiers |= {t: v for t, v in twins.items() if t and t.startswith(FREE_TWIN)}
        for tier, start in tiers.items():
            for mode in preset.kv_loads:
                for label, room in preset.hardware.items():
                    for world_name, world in preset.worlds.items():
                        config = trace.config.override(
                            "cluster",
                            kv_load=mode,
                            hardware=room.hardware,
                            kv_dtype=room.kv_dtype,
                            **world,
                        ).override("cluster", **_tier_settings(tier))
                        key = (name, tier, mode, label, world_name)
                        cells[key] = (config, start * trace.scale[label])
    return cells


def run_grid(
    preset: GridPreset,
    policies: Sequence[str],
    load: TraceLoader,
    store: RunStore,
    processes: int,
    on_round: Callable[[str, int, int], None],
) -> GridResult:
    """Every cell's knees under the default and the looser SLO."""
    cells = grid_cells(preset)
    seeds = range(preset.seeds)
    out = []
    for name in preset.traces:
        mine = {key: value for key, value in cells.items() if key[0] == name}
        trace = load(next(iter(mine.values()))[0])
        searches = {
            (*key, p): dataclasses.replace(config, policies=(p,))
            for key, (config, _) in mine.items()
            for p in policies
        }
        settings = {
            key: KneeSettings(start=mine[key[:-1]][1], grow=preset.grow, precision=preset.precision)
            for key in searches
        }
        knees = search_knees(
            searches,
            seeds,
            settings,
            processes,
            trace,
            functools.partial(on_round, name),
            store,
            with_requests=True,
        )
        for key in mine:
            default = {p: knees[(*key, p)] for p in policies}
            loose = {
                p: rescored_knee(store, (*key, p), searches[(*key, p)], k, seeds, preset.loose_slo)
                for p, k in default.items()
            }
            trace_name, tier, mode, hardware, world = key
            out.append(
                GridCell(
                    trace=trace_name,
                    tier=tier,
                    kv_load=mode,
                    hardware=hardware,
                    world=world,
                    knees=default,
                    loose=loose,
                )
            )
    return GridResult(
        preset=preset.name,
        policies=list(policies),
        worlds=preset.worlds,
        seeds=preset.seeds,
        precision=preset.precision,
        slo=dataclasses.asdict(next(iter(preset.traces.values())).config.slo),
        loose_slo=dataclasses.asdict(preset.loose_slo),
        cells=out,
    )


def rescored_knee(
    store: RunStore,
    key: tuple,
    config: SimConfig,
    knee: Knee,
    seeds: Sequence[int],
    slo: SLOConfig,
) -> Knee:
    """The knee among ``knee``'s probed loads when their stored runs are scored under
    ``slo``."""
    runs = {}
    for load in knee.probes:
        values = []
        for seed in seeds:
            job = probe_job(key, config, load, seed)
            summary = store.stored(job, with_requests=True)
            values.append(
                tps_under_slo(store.requests(job), summary, slo, config.cluster.instances)
            )
        runs[load] = values
    return knee_of(runs)


@dataclass(frozen=True)
class Verdict:
    """A cell's best baseline at its best setting, its mean, and each of our policies'
    lead over it in percent (None where no baseline ran or the best made nothing)."""

    best_baseline: str | None
    value: float | None
    lead: dict[str, float | None]


def cell_verdict(means: Mapping[str, float]) -> Verdict:
    """The verdict of a cell with ``{policy: mean}``."""
    rival = best_baseline(means)
    top = means[rival] if rival is not None else 0.0
    return Verdict(
        best_baseline=rival,
        value=top if rival is not None else None,
        lead={p: (means[p] / top - 1) * 100 if top > 0 else None for p in means if is_ours(p)},
    )


def verdict_summary(cells: Sequence[Mapping[str, float]]) -> dict[str, dict[str, int]]:
    """Per policy of ours, over the cells (each ``{policy: mean}``): how many cells it
    is within 1 % of the best baseline (or ahead), and how many at least 5 % ahead."""
    leads = [cell_verdict(means).lead for means in cells]
    ours = list(dict.fromkeys(p for lead in leads for p in lead))

    def count(p: str, threshold: float) -> int:
        # A lead is a ratio's rounding away from its threshold (99 / 100 - 1 is below
        # -1 %), hence the tolerance.
        return sum(1 for lead in leads if (v := lead.get(p)) is not None and v >= threshold - 1e-9)

    return {
        p: {
            "cells": sum(1 for lead in leads if lead.get(p) is not None),
            "within_1pct": count(p, WITHIN),
            "ahead_5pct": count(p, AHEAD),
        }
        for p in ours
    }


def means_of(cell: GridCell, which: Which = "knees") -> dict[str, float]:
    """``{policy: mean TPS within SLO at its knee}`` of a result cell."""
    return {p: k.mean for p, k in cell.of(which).items()}
