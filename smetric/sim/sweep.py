"""A sweep: offered rate x global-tier provisioning x policy (x seed), and its summary.

Each cell is one configuration run under one policy; with several seeds a cell's numbers
are the mean over them, and a policy's best rate per provisioning is the one with the
best mean TPS within SLO (the paper's Figures 11a/16a).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from smetric.core.errors import ConfigError
from smetric.metrics.results import BestRate, RunSummary, SweepResult, SweepRun
from smetric.sim.config import SimConfig
from smetric.sim.jobs import Job
from smetric.sim.seeds import mean_summary, spread


def parse_rates(text: str, what: str = "--rates") -> list[float]:
    """'0.1,0.2' -> the offered rates; a ``ConfigError`` naming ``what`` unless all are positive."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"{what}: expected comma-separated numbers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"{what}: expected positive numbers, got {text!r}")
    return values


def sweep_jobs(
    base: SimConfig, rates: Sequence[float], provisionings: Sequence[str], seeds: int
) -> list[Job]:
    """Every run of the sweep, keyed (rate, provisioning, policy, seed); the seeds run
    from the base configuration's own."""
    first = base.workload.seed
    return [
        Job(
            (r, g, p, s),
            base.override("workload", session_rate=r, seed=s).override(
                "cluster", global_capacity=g
            ),
            p,
        )
        for g in provisionings
        for p in base.policies
        for r in rates
        for s in range(first, first + seeds)
    ]


def sweep_cells(
    jobs: Sequence[Job], results: Mapping[tuple, RunSummary]
) -> dict[tuple, list[RunSummary]]:
    """Each (rate, provisioning, policy) cell's summaries, in seed order whatever order
    the runs finished in."""
    cells: dict[tuple, list[RunSummary]] = {}
    for job in jobs:
        cells.setdefault(job.key[:3], []).append(results[job.key])
    return cells


def sweep_summary(
    rates: list[float],
    provisionings: list[str],
    policies: tuple[str, ...],
    results: Mapping[tuple, Sequence[RunSummary]],
) -> SweepResult:
    """Every cell's summary, and each policy's best TPS within SLO per provisioning.

    ``results`` holds each (rate, provisioning, policy) cell's summaries, one per seed.
    With several seeds a cell's summary is their mean (``mean_summary``) with the seeds'
    TPS within SLO and its standard deviation beside it, and the best rate is the one with
    the best mean; with one seed the cell is that run's summary as it is.
    """
    runs = []
    for g in provisionings:
        for p in policies:
            for r in rates:
                per_seed = results[(r, g, p)]
                if len(per_seed) == 1:
                    runs.append(SweepRun(rate=r, global_=g, policy=p, summary=per_seed[0]))
                    continue
                values = [s.tps_within_slo for s in per_seed]
                merged = mean_summary([s.to_builtins() for s in per_seed])
                runs.append(
                    SweepRun(
                        rate=r,
                        global_=g,
                        policy=p,
                        summary=RunSummary.from_builtins(merged),
                        seeds_tps=values,
                        stdev=spread(values),
                    )
                )
    best: dict[str, dict[str, BestRate]] = {}
    for run in runs:
        slot = best.setdefault(run.global_, {})
        current = slot.get(run.policy)
        tps = run.summary.tps_within_slo
        if current is None or tps > current.tps:
            slot[run.policy] = BestRate(tps=tps, rate=run.rate, stdev=run.stdev)
    seeds = max(len(v) for v in results.values())
    return SweepResult(
        rates=rates,
        provisionings=provisionings,
        policies=list(policies),
        runs=runs,
        max_tps=best,
        seeds=seeds if seeds > 1 else None,
    )
