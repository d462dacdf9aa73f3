"""Each policy's knee: the offered load at which its TPS within SLO peaks, found adaptively.

TPS within SLO grows with the offered load until queues build and requests start missing
their SLOs, then falls. A fixed grid of rates misses that peak by up to its spacing, and
each policy peaks at its own load. The search here probes a policy's load in geometric
steps until the value stops rising (or, from too high a start, stops rising downward),
then bisects the bracket around the best probe in log space until both sides are within
``precision`` of it. Each probe's value is a mean over seeds, supplied by the caller, so
the search itself is a pure function of the values it has seen.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from smetric.core.policies import is_ours
from smetric.core.settings import check_settings, setting
from smetric.metrics.results import Knee, KneeCell, KneeSummary
from smetric.sim.config import SimConfig
from smetric.sim.jobs import Job
from smetric.sim.parallel import RunStore, run_sweep
from smetric.trace.schema import Trace


@dataclass(frozen=True)
class KneeSettings:
    """How a knee is searched: the one declaration of the commands' knee-search flags."""

    start: float = setting(0.1, "First load probed: sessions/s, or the open-loop speed-up.", gt=0)
    grow: float = setting(2.0, "Step factor until the knee is bracketed.", gt=1)
    precision: float = setting(1.2, "Stop when the knee is bracketed within this factor.", gt=1)
    # A flat or noisy curve never brackets: the cap ends its search.
    max_probes: int = setting(10, "Probes per search at most.", ge=2)

    def __post_init__(self) -> None:
        check_settings(self)


def next_load(probes: Mapping[float, float], settings: KneeSettings) -> float | None:
    """The next load to probe given ``{load: mean TPS within SLO}``, or None when done."""
    if not probes:
        return settings.start
    if len(probes) >= settings.max_probes:
        return None
    loads = sorted(probes)
    best = max(loads, key=lambda load: (probes[load], -load))
    i = loads.index(best)
    if i == len(loads) - 1:
        return best * settings.grow  # still rising: step up
    if i == 0:
        return best / settings.grow  # the start was already past the knee: step down
    low, high = loads[i - 1], loads[i + 1]
    # The wider gap, in log space; on a tie the upper one, where curves fall off faster.
    ratio, a, b = max((best / low, low, best), (high / best, best, high))
    if ratio <= settings.precision:
        return None
    return math.sqrt(a * b)


def knee_of(runs: Mapping[float, Sequence[float]]) -> Knee:
    """The knee among probed loads, each with its per-seed values."""
    means = {load: statistics.fmean(values) for load, values in runs.items()}
    best = max(sorted(means), key=lambda load: (means[load], -load))
    values = tuple(runs[best])
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return Knee(
        load=best, mean=means[best], stdev=spread, seeds=values, probes=dict(sorted(means.items()))
    )


def best_of(knee: Knee, runs: Mapping[float, Sequence[float]]) -> Knee:
    """The knee over the search's probes and further runs of the same cell (a rate
    sweep's points, each with its per-seed values): a policy's maximum TPS within SLO is
    its best over every load it was run at, whichever figure ran it."""
    means = dict(knee.probes)
    per_seed = {knee.load: knee.seeds}
    for load, values in runs.items():
        means[load] = statistics.fmean(values)
        per_seed[load] = tuple(values)
    best = max(sorted(per_seed), key=lambda load: (means[load], -load))
    values = per_seed[best]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return Knee(
        load=best, mean=means[best], stdev=spread, seeds=values, probes=dict(sorted(means.items()))
    )


def best_baseline(values: Mapping[str, float]) -> str | None:
    """The baseline with the highest value (a knee's mean TPS, say), at its best setting:
    of ``linear:lam=0.3`` and ``linear:lam=0.9`` the better one counts."""
    rivals = [p for p in values if not is_ours(p)]
    return max(rivals, key=lambda p: values[p]) if rivals else None


def knee_summary(
    cells: Sequence[tuple[str, str]],
    policies: Sequence[str],
    knees: Mapping[tuple, Knee],
    seeds: int | None = None,
    settings: KneeSettings | None = None,
) -> KneeSummary:
    """Per (global tier, load mode) cell, every policy's knee and the best baseline; with
    the seeds and settings of the search that found them, where given."""
    out = []
    for glob, load in cells:
        per_policy = {p: knees[(glob, load, p)] for p in policies}
        rival = best_baseline({p: k.mean for p, k in per_policy.items()})
        out.append(KneeCell(global_=glob, kv_load=load, knees=per_policy, best_baseline=rival))
    return KneeSummary(
        policies=list(policies),
        cells=out,
        seeds=seeds,
        settings=None if settings is None else dataclasses.asdict(settings),
    )


def with_load(config: SimConfig, load: float) -> SimConfig:
    """The configuration at an offered load: session starts per second in closed loop, the
    replay speed-up in open loop (the recorded arrivals compressed by ``load``)."""
    if config.workload.open_loop:
        return config.override("workload", speed=load)
    return config.override("workload", session_rate=load)


def probe_job(key: tuple, config: SimConfig, load: float, seed: int) -> Job:
    """The run behind one seed of one probe of a cell (``config.policies[0]`` at ``load``):
    the same job, so the same ``RunStore`` entry, whoever asks for it."""
    return Job(
        (key, load, seed),
        with_load(config, load).override("workload", seed=seed),
        config.policies[0],
    )


def search_knees(
    cells: Mapping[tuple, SimConfig],
    seeds: Sequence[int],
    settings: KneeSettings | Mapping[tuple, KneeSettings],
    processes: int,
    trace: Trace,
    on_round: Callable[[int, int], None] | None = None,
    store: RunStore | None = None,
    with_requests: bool = False,
) -> dict[tuple, Knee]:
    """Every cell's knee (a cell: a configuration and one policy, ``config.policies[0]``).

    All searches advance together, one probe each per round, so a round's runs (probes x
    seeds) fill the worker processes. ``settings`` may differ per cell (a start near each
    cell's knee saves rounds). With a ``store``, every probe is kept there and one already
    there is not run again, so an interrupted search resumes. ``on_round(round, runs)``
    reports progress; ``with_requests`` stores each run's per-request table too (to score
    it again under another SLO).
    """
    # Per cell and load, each seed's value: kept by seed, so that means do not depend on
    # the order in which worker processes finish.
    runs: dict[tuple, dict[float, dict[int, float]]] = {key: {} for key in cells}
    probes: dict[tuple, dict[float, float]] = {key: {} for key in cells}
    per_cell = {
        key: settings if isinstance(settings, KneeSettings) else settings[key] for key in cells
    }
    rounds = 0
    while True:
        wanted = {key: next_load(probes[key], per_cell[key]) for key in cells}
        jobs = [
            probe_job(key, cells[key], load, seed)
            for key, load in wanted.items()
            if load is not None
            for seed in seeds
        ]
        if not jobs:
            break
        rounds += 1
        if on_round is not None:
            on_round(rounds, len(jobs))
        summaries, _ = run_sweep(
            jobs, store, trace, processes=processes, with_requests=with_requests
        )
        for (key, load, seed), summary in summaries.items():
            runs[key].setdefault(load, {})[seed] = summary.tps_within_slo
        for key, load in wanted.items():
            if load is not None:
                probes[key][load] = statistics.fmean(by_seed(runs[key][load]))
    return {key: knee_of({load: by_seed(v) for load, v in runs[key].items()}) for key in cells}


def by_seed(values: Mapping[int, float]) -> list[float]:
    return [values[seed] for seed in sorted(values)]
