"""Capacity planning: the fewest instances, and the global tier, that serve a trace within SLO.

A cluster of ``n`` instances *serves* a trace when, at the trace's own offered load (its
recorded arrivals at speed 1, or for a trace without a clock, sessions at the configured
rate):

* its knee lies at or beyond that load: more load would still raise its TPS within SLO,
  so the trace does not push it past saturation (``sim.knee``, searched from the trace's
  own load upward, so that load is always the search's first probe); and
* at least ``attainment`` of the requests completed in the measured window meet both SLOs.

For each policy and global-tier setting the smallest such ``n`` is found by doubling from
``min_instances`` until one serves, then bisecting; more instances are assumed never to
serve worse. Every probe of every knee search goes through the ``RunStore``, so asking
again (with more policies, another SLO attainment, a wider search) simulates only what is
new. A policy's plan is its fewest instances, with the smallest global tier that achieves
them (tiers in the order given, smallest first).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from smetric.core.errors import ConfigError
from smetric.core.settings import check_settings, setting
from smetric.metrics.results import Plan, PlanPoint, PlanResult
from smetric.sim.cluster import resolve_shape
from smetric.sim.config import SimConfig
from smetric.sim.knee import KneeSettings, probe_job, search_knees
from smetric.sim.parallel import RunStore, run_sweep
from smetric.trace.schema import Trace

HOURS = 3600.0


@dataclass(frozen=True)
class PlanSettings:
    """What ``smetric plan`` searches: the one declaration of its flags."""

    # Global tiers tried, smallest first: none, a multiple of local capacity, full.
    globals: tuple[str, ...] = ("none", "1x", "full")
    min_instances: int = setting(1, "Fewest instances tried.", ge=1)
    max_instances: int = setting(64, "Most instances tried.", ge=1)
    attainment: float = setting(
        0.95, "Share of requests that must meet both SLOs at the trace's own load.", gt=0, le=1
    )
    seeds: int = setting(1, "Seeds per probe (0, 1, ...).", ge=1)
    price_per_gpu_hour: float | None = setting(
        None, "Price of one GPU-hour, for $ per M tokens.", gt=0
    )
    # Each instance count's knee search; it starts at the trace's own load.
    knee: KneeSettings = field(default_factory=KneeSettings)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.min_instances > self.max_instances:
            raise ConfigError("instances: need --min-instances <= --max-instances")
        if not self.globals:
            raise ConfigError("plan needs at least one global tier")


@dataclass
class _Bisection:
    """Smallest serving count in ``[least, most]``: ``fails`` is the largest known not to
    serve, ``serves`` the smallest known to."""

    least: int
    most: int
    fails: int = 0
    serves: int | None = None

    def next(self) -> int | None:
        if self.serves is None:
            if self.fails >= self.most:
                return None
            return self.least if self.fails < self.least else min(self.fails * 2, self.most)
        if self.serves - self.fails <= 1 or self.serves == self.least:
            return None
        return max((self.fails + self.serves) // 2, self.least)


def trace_load(config: SimConfig) -> float:
    """The trace's own offered load in the knee search's unit (``sim.knee.with_load``)."""
    return config.workload.speed if config.workload.open_loop else config.workload.session_rate


def search_plan(
    base: SimConfig,
    trace: Trace,
    settings: PlanSettings,
    processes: int,
    store: RunStore,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[tuple[str, str], list[PlanPoint]]:
    """Every probed instance count per (policy, global tier), in increasing count."""
    if base.cluster.prefill_instances or base.cluster.decode_instances:
        raise ConfigError("plan sizes colocated clusters; drop the prefill/decode instances")
    load = trace_load(base)
    knee_settings = dataclasses.replace(settings.knee, start=load)
    seeds = range(settings.seeds)
    families = [(p, g) for p in base.policies for g in settings.globals]
    searches = {key: _Bisection(settings.min_instances, settings.max_instances) for key in families}
    points: dict[tuple[str, str], dict[int, PlanPoint]] = {key: {} for key in families}
    while True:
        wanted = {key: s.next() for key, s in searches.items()}
        cells = {
            (policy, glob, n): dataclasses.replace(
                base.override("cluster", instances=n, global_capacity=glob), policies=(policy,)
            )
            for (policy, glob), n in wanted.items()
            if n is not None
        }
        if not cells:
            break
        knees = search_knees(cells, seeds, knee_settings, processes, trace, on_round, store)
        # The first probe of every search ran at the trace's own load: stored already.
        jobs = [probe_job(key, cells[key], load, s) for key in cells for s in seeds]
        summaries, _ = run_sweep(jobs, store, trace, processes=processes)
        for key in cells:
            policy, glob, n = key
            runs = [summaries[(key, load, s)] for s in seeds]
            knee = knees[key]
            attainment = statistics.fmean(r.slo_attainment for r in runs)
            serves = knee.load >= load and attainment >= settings.attainment
            points[(policy, glob)][n] = PlanPoint(
                instances=n,
                tps_within_slo=statistics.fmean(r.tps_within_slo for r in runs),
                slo_attainment=attainment,
                knee_load=knee.load,
                knee_tps_within_slo=knee.mean,
                serves=serves,
            )
            search = searches[(policy, glob)]
            if serves:
                search.serves = n
            else:
                search.fails = n
    return {key: [found[n] for n in sorted(found)] for key, found in points.items()}


def fewest(points: Sequence[PlanPoint]) -> PlanPoint | None:
    serving = [p for p in points if p.serves]
    return min(serving, key=lambda p: p.instances) if serving else None


def global_tier_bytes(config: SimConfig, glob: str, instances: int, block_size: int) -> int | None:
    """The global tier's size for ``instances`` instances (None: unbounded, never evicts)."""
    cluster = dataclasses.replace(config.cluster, instances=instances, global_capacity=glob)
    shape = resolve_shape(cluster, block_size)
    if shape.global_capacity_blocks is None:
        return None
    return shape.global_capacity_blocks * block_size * shape.kv_bytes_per_token


def plan_summary(
    base: SimConfig,
    points: dict[tuple[str, str], list[PlanPoint]],
    settings: PlanSettings,
    block_size: int,
    runs_simulated: int | None = None,
) -> PlanResult:
    """The plans and every probed point (and how many runs were simulated for them, not
    taken from a store, where counted)."""
    gpus = base.cluster.gpus_per_instance
    curves: dict[str, dict[str, list[PlanPoint]]] = {}
    plans: dict[str, Plan | None] = {}
    for policy in base.policies:
        curves[policy] = {}
        best: tuple[PlanPoint, str] | None = None
        for glob in settings.globals:
            found = curves[policy][glob] = points[(policy, glob)]
            smallest = fewest(found)
            if smallest is not None and (best is None or smallest.instances < best[0].instances):
                best = (smallest, glob)
        if best is None:
            plans[policy] = None
            continue
        point, glob = best
        cost = None
        if settings.price_per_gpu_hour is not None and point.tps_within_slo > 0:
            per_hour = point.instances * gpus * settings.price_per_gpu_hour
            cost = per_hour / (point.tps_within_slo * HOURS / 1e6)
        plans[policy] = Plan(
            instances=point.instances,
            gpus=point.instances * gpus,
            global_=glob,
            global_bytes=global_tier_bytes(base, glob, point.instances, block_size),
            tps_within_slo=point.tps_within_slo,
            slo_attainment=point.slo_attainment,
            knee_load=point.knee_load,
            cost_per_million_tokens=cost,
        )
    ranked = {p: plan for p in base.policies if (plan := plans[p]) is not None}
    choice = min(
        ranked,
        key=lambda p: (ranked[p].instances, settings.globals.index(ranked[p].global_)),
        default=None,
    )
    return PlanResult(
        trace_load=trace_load(base),
        load_unit="speed-up" if base.workload.open_loop else "sessions/s",
        attainment=settings.attainment,
        seeds=list(range(settings.seeds)),
        instances_searched=[settings.min_instances, settings.max_instances],
        price_per_gpu_hour=settings.price_per_gpu_hour,
        policies=list(base.policies),
        globals=list(settings.globals),
        plans=plans,
        choice=choice,
        curves=curves,
        runs_simulated=runs_simulated,
    )
