"""The runs behind the paper's colocation figures, and the numbers drawn from them.

Every run goes through the knee search and the sweep runner with one ``RunStore``, so a
run shared by two figures (a knee probe that is also a rate-sweep point, SMetric at its
defaults in the sensitivity sweep) runs once, and running the evaluation again reuses
every finished run. The result is plain JSON-able data, a pure function of the trace,
preset and policies: the same inputs give byte-identical ``reproduce.json``.

Loads: the paper gives Figure 15a's offered loads as multiples (1.0x ... 2.0x) of an
unstated rate, notes that scheduling matters little at 1.0x, that the cluster saturates
near 1.5x (where SMetric leads by 15 %) and is severely overloaded at 2.0x, and measures
Figures 14, 17 and 25 at 1.5x. Here 1.5x is defined as the best baseline's knee on the
full global tier (the load where the strongest baseline's TPS within SLO peaks), so the
load unit 1.0x is two thirds of it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from smetric.core.errors import UserError
from smetric.core.policies import policy_params
from smetric.eval.grid import FREE_GLOBAL_TIER, FREE_TIER
from smetric.eval.preset import REFERENCE_TIER, Preset
from smetric.sim.config import SimConfig
from smetric.sim.jobs import Job
from smetric.sim.knee import (
    Knee,
    KneeSettings,
    best_baseline,
    best_of,
    probe_job,
    search_knees,
)
from smetric.sim.parallel import RunStore, run_sweep
from smetric.trace.schema import Trace

# The paper's baselines as it names them; the list is open: any policy spec works, and
# every policy of the SMetric family (``is_ours``) is compared with the best of the rest.
DEFAULT_POLICIES = (
    "smetric",
    "smetric_cost",
    "least_load",
    "cache_aware",
    "lmetric",
    "linear:lam=0.3",
    "linear",
)
PAPER_LOAD = 1.5  # Figures 14, 17 and 25 are measured at 1.5x Figure 15a's load unit
GUARD_OFF = "smetric:overload=inf"  # SMetric without its overload guard (Fig. 14)
TIERS = ("local", "global", "miss")  # where a prompt token's KV came from

# Progress: what is running, runs done, runs in all (None while a knee search decides).
Progress = Callable[[str, int, int | None], None]


@dataclass
class Runner:
    """Runs jobs through one store, each distinct configuration once."""

    trace: Trace
    store: RunStore
    processes: int
    progress: Progress

    def run(self, what: str, jobs: Sequence[Job], with_requests: bool = False) -> dict:
        """Summaries by job key; jobs with the same run id share one run."""
        unique = list({job.run_id: job for job in jobs}.values())

        def show(done: int, _inflight: Mapping[str, int]) -> None:
            self.progress(what, done, len(unique))

        by_key, _ = run_sweep(
            unique,
            self.store,
            self.trace,
            processes=self.processes,
            progress=show,
            with_requests=with_requests,
        )
        by_id = {job.run_id: by_key[job.key] for job in unique}
        return {job.key: by_id[job.run_id] for job in jobs}


def at_load(config: SimConfig, policy: str, rate: float, seed: int, key: tuple) -> Job:
    return Job(key, config.override("workload", session_rate=rate, seed=seed), policy)


def reproduce(
    trace: Trace,
    preset: Preset,
    policies: Sequence[str],
    store: RunStore,
    processes: int,
    progress: Progress,
) -> dict:
    """Every figure's data (see the module doc), as JSON-able dicts and lists."""
    base = dataclasses.replace(preset.config, policies=tuple(policies))
    runner = Runner(trace, store, processes, progress)
    seeds = range(preset.seeds)
    tiers = _tiers(runner, base, preset, policies)
    ceiling = tiers.pop(FREE_TIER, None)
    full = base.override("cluster", global_capacity=REFERENCE_TIER)
    reference = tiers[REFERENCE_TIER]["best_baseline"] or policies[0]
    knee_load = tiers[REFERENCE_TIER]["policies"][reference]["knee"]["load"]
    unit = knee_load / PAPER_LOAD

    def rate(multiple: float) -> float:
        # knee_load * 1.0 at 1.5x exactly, so the same run ids as that knee's probes.
        return knee_load * (multiple / PAPER_LOAD)

    at_paper = [
        at_load(full, p, rate(PAPER_LOAD), s, ("paper", p, s)) for p in policies for s in seeds
    ]
    detail = runner.run("1.5x load, per-request tables", at_paper, with_requests=True)
    sweep_jobs = [
        at_load(full, p, rate(m), s, ("rate", p, m, s))
        for p in policies
        for m in preset.load_multiples
        for s in seeds
    ]
    overloads = _variants("overload", preset.overloads)
    hit_ratios = _variants("hit_ratio", preset.hit_ratios)
    specs = list(dict.fromkeys([*overloads.values(), *hit_ratios.values(), "smetric", GUARD_OFF]))
    extra = [
        at_load(full, spec, rate(PAPER_LOAD), s, ("variant", spec, s))
        for spec in specs
        for s in seeds
    ]
    summaries = runner.run("rate sweep and sensitivity", [*sweep_jobs, *extra])
    _with_rate_sweep(tiers[REFERENCE_TIER], preset.load_multiples, rate, seeds, summaries)
    variant = {spec: [summaries["variant", spec, s] for s in seeds] for spec in specs}
    paper_summaries = {p: [detail["paper", p, s] for s in seeds] for p in policies}
    return {
        "preset": preset.name,
        "setup": preset.describe(),
        "trace": trace.name,
        "config": base.to_dict(),
        "seeds": preset.seeds,
        "policies": list(policies),
        "tiers": tiers,
        # The same cluster with a free global tier, the best of every policy's knee there.
        "ceiling": ceiling,
        "load_unit": {
            "rate": unit,
            "reference_policy": reference,
            "reference_knee": knee_load,
            "paper_load": PAPER_LOAD,
        },
        "rate_sweep": {
            "multiples": list(preset.load_multiples),
            "rates": [rate(m) for m in preset.load_multiples],
            "policies": {
                p: [
                    _mean_point([summaries["rate", p, m, s] for s in seeds])
                    for m in preset.load_multiples
                ]
                for p in policies
            },
        },
        "at_paper_load": {
            "rate": rate(PAPER_LOAD),
            "policies": {p: _point(runs) for p, runs in paper_summaries.items()},
        },
        "guard": {spec: _guard(variant[spec], base.window_s) for spec in ("smetric", GUARD_OFF)},
        "sensitivity": {
            "overload": _sweep(overloads, variant),
            "hit_ratio": _sweep(hit_ratios, variant),
        },
    }


def paper_load_runs(
    store: RunStore, preset: Preset, policies: Sequence[str], result: Mapping
) -> tuple[dict[str, dict], dict[str, pl.DataFrame]]:
    """The first seed's summary and per-request table at 1.5x load, per policy: what the
    per-run figures (latency CDFs, heatmaps, stickiness) draw."""
    full = preset.config.override("cluster", global_capacity=REFERENCE_TIER)
    rate = result["at_paper_load"]["rate"]
    jobs = {p: at_load(full, p, rate, 0, ("paper", p, 0)) for p in policies}
    summaries = {p: store.get(job) for p, job in jobs.items()}
    if any(summary is None for summary in summaries.values()):
        raise UserError(f"{store.folder}: runs at {PAPER_LOAD:g}x load are missing")
    return (
        {p: s for p, s in summaries.items() if s is not None},
        {p: store.requests(job) for p, job in jobs.items()},
    )


def _variants(param: str, values: Sequence[float]) -> dict[float, str]:
    """SMetric at each value of one parameter; its default is plain ``smetric``, so that
    point is the same run as SMetric's everywhere else."""
    default = policy_params("smetric")[param]
    return {v: "smetric" if v == default else f"smetric:{param}={v:g}" for v in values}


def _tiers(runner: Runner, base: SimConfig, preset: Preset, policies: Sequence[str]) -> dict:
    """Each policy's knee per global tier (Figs. 11a/16a), and its hit split there (11b)."""
    cells = {
        (tier, p): dataclasses.replace(
            base.override("cluster", global_capacity=tier), policies=(p,)
        )
        for tier in preset.tiers
        for p in policies
    }
    starts = dict(preset.tiers)
    if preset.ceiling:
        starts[FREE_TIER] = max(preset.tiers.values())
        for p in policies:
            free = base.override("cluster", **FREE_GLOBAL_TIER)
            cells[FREE_TIER, p] = dataclasses.replace(free, policies=(p,))
    settings = {
        key: KneeSettings(start=starts[key[0]], precision=preset.precision) for key in cells
    }

    def on_round(round_: int, runs: int) -> None:
        runner.progress(f"knee search, round {round_} ({runs} runs)", 0, None)

    seeds = range(preset.seeds)
    knees = search_knees(
        cells, seeds, settings, runner.processes, runner.trace, on_round, runner.store
    )
    out = {}
    for tier in preset.tiers:
        per_policy: dict[str, dict] = {}
        for p in policies:
            knee: Knee = knees[tier, p]
            runs = [
                runner.store.stored(probe_job((tier, p), cells[tier, p], knee.load, s))
                for s in seeds
            ]
            per_policy[p] = {"knee": dataclasses.asdict(knee), **_point(runs)}
        rival = best_baseline({p: v["knee"]["mean"] for p, v in per_policy.items()})
        out[tier] = {"best_baseline": rival, "policies": per_policy}
    if preset.ceiling:
        ceilings = {p: dataclasses.asdict(knees[FREE_TIER, p]) for p in policies}
        best = max(ceilings, key=lambda p: ceilings[p]["mean"])
        out[FREE_TIER] = {"best": best, "knees": ceilings}
    return out


def _with_rate_sweep(
    tier: dict,
    multiples: Sequence[float],
    rate: Callable[[float], float],
    seeds: Sequence[int],
    summaries: Mapping[tuple, Mapping],
) -> None:
    """Fold the full tier's rate sweep into its knees: where a sweep point beats the
    search's best probe, that point is the policy's maximum TPS within SLO, so the knee
    table, the headline and the rate figure agree. The load unit stays the searched knee
    of the best baseline (the sweep's rates are defined by it)."""
    for p, entry in tier["policies"].items():
        runs = {rate(m): [summaries["rate", p, m, s] for s in seeds] for m in multiples}
        knee = Knee(**entry["knee"])
        best = best_of(knee, {load: [r["tps_within_slo"] for r in rs] for load, rs in runs.items()})
        point = _point(runs[best.load]) if best.load != knee.load else entry
        tier["policies"][p] = {
            "knee": dataclasses.asdict(best),
            **{k: v for k, v in point.items() if k != "knee"},
        }
    tier["best_baseline"] = best_baseline(
        {p: v["knee"]["mean"] for p, v in tier["policies"].items()}
    )


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(present) if present else None


def _mean_point(runs: Sequence[Mapping]) -> dict:
    """TPS within SLO over seeds (mean and spread) and the mean hit split."""
    tps = [r["tps_within_slo"] for r in runs]
    return {
        "tps_within_slo": statistics.fmean(tps),
        "stdev": statistics.stdev(tps) if len(tps) > 1 else 0.0,
        "reuse": {k: statistics.fmean(r["reuse"][k] for r in runs) for k in TIERS},
    }


def _point(runs: Sequence[Mapping]) -> dict:
    """What the figures and the paper's table read of one configuration's runs: means
    over seeds of TPS, hit split, latency percentiles, imbalance and stickiness."""
    return _mean_point(runs) | {
        "slo_attainment": statistics.fmean(r["slo_attainment"] for r in runs),
        "ttft_s": {q: _mean([r["ttft_s"][q] for r in runs]) for q in ("p50", "p90", "p99")},
        "tpot_s": {q: _mean([r["tpot_s"][q] for r in runs]) for q in ("p50", "p90", "p99")},
        "imbalance": _mean([_mean(measured_imbalance(r)) for r in runs]),
        "stickiness": {
            k: _mean([r["stickiness"][k] for r in runs]) for k in ("session", "agent", "turn")
        },
    }


def window_imbalance(heatmap: Sequence[Sequence[float]]) -> list[float | None]:
    """Max over mean load per window (None where the cluster was idle), in time order."""
    loads = np.asarray(heatmap, dtype=float)
    mean = loads.mean(axis=0)
    top = loads.max(axis=0)
    return [float(t / m) if m > 0 else None for t, m in zip(top, mean, strict=True)]


def measured_imbalance(summary: Mapping) -> list[float]:
    """The busy windows' imbalance after the warm-up (the run summary counts only those:
    while sessions ramp up a few long ones dominate the load, which says nothing about a
    policy's steady state)."""
    return list(summary["imbalance"]["series"])


def _guard(runs: Sequence[Mapping], window_s: float) -> dict:
    """Per-window imbalance over time (first seed, warm-up included) and over all seeds'
    busy windows after the warm-up."""
    pooled = [v for r in runs for v in measured_imbalance(r)]
    return {
        "window_s": window_s,
        "warmup_s": runs[0]["warmup_s"],
        "over_time": window_imbalance(runs[0]["load_heatmap"]),
        "windows": pooled,
        "percentiles": {
            f"p{q}": float(np.percentile(pooled, q)) if pooled else None for q in (50, 75, 90, 99)
        },
        "mean": _mean(pooled),
        "tps_within_slo": statistics.fmean(r["tps_within_slo"] for r in runs),
    }


def _sweep(variants: Mapping[float, str], runs: Mapping[str, list]) -> list[dict]:
    """One point per value; ``value`` is None for infinity (JSON has none), ``label`` the
    value as written ("inf")."""
    return [
        {
            "value": value if math.isfinite(value) else None,
            "label": f"{value:g}",
            "policy": spec,
            **_mean_point(runs[spec]),
        }
        for value, spec in variants.items()
    ]
