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

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from smetric.sim.config import SimConfig
from smetric.sim.parallel import Job, run_jobs
from smetric.trace.schema import Trace


@dataclass(frozen=True)
class KneeSettings:
    start: float
    grow: float = 2.0
    # Stop once the best probe's neighbours are within this factor of it.
    precision: float = 1.2
    # Probes at most, whatever the values do (a flat or noisy curve).
    max_probes: int = 10

    def __post_init__(self) -> None:
        if self.start <= 0 or self.grow <= 1 or self.precision <= 1 or self.max_probes < 1:
            raise ValueError(f"bad knee search settings: {self}")


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


@dataclass(frozen=True)
class Knee:
    """A policy's best load, its mean and spread over seeds there, and every probe."""

    load: float
    mean: float
    stdev: float
    seeds: tuple[float, ...]
    probes: dict[float, float]


def knee_of(runs: Mapping[float, Sequence[float]]) -> Knee:
    """The knee among probed loads, each with its per-seed values."""
    means = {load: statistics.fmean(values) for load, values in runs.items()}
    best = max(sorted(means), key=lambda load: (means[load], -load))
    values = tuple(runs[best])
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return Knee(best, means[best], spread, values, dict(sorted(means.items())))


def with_load(config: SimConfig, load: float) -> SimConfig:
    """The configuration at an offered load: session starts per second in closed loop, the
    replay speed-up in open loop (the recorded arrivals compressed by ``load``)."""
    if config.workload.open_loop:
        return config.override("workload", speed=load)
    return config.override("workload", session_rate=load)


def search_knees(
    cells: Mapping[tuple, SimConfig],
    seeds: Sequence[int],
    settings: KneeSettings,
    processes: int,
    trace: Trace,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[tuple, Knee]:
    """Every cell's knee (a cell: a configuration and one policy, ``config.policies[0]``).

    All searches advance together, one probe each per round, so a round's runs (probes x
    seeds) fill the worker processes. ``on_round(round, runs)`` reports progress.
    """
    # Per cell and load, each seed's value: kept by seed, so that means do not depend on
    # the order in which worker processes finish.
    runs: dict[tuple, dict[float, dict[int, float]]] = {key: {} for key in cells}
    probes: dict[tuple, dict[float, float]] = {key: {} for key in cells}
    first = next(iter(cells.values()))
    rounds = 0
    while True:
        wanted = {key: next_load(probes[key], settings) for key in cells}
        jobs = [
            Job(
                (key, load, seed),
                with_load(cells[key], load).override("workload", seed=seed),
                cells[key].policies[0],
            )
            for key, load in wanted.items()
            if load is not None
            for seed in seeds
        ]
        if not jobs:
            break
        rounds += 1
        if on_round is not None:
            on_round(rounds, len(jobs))
        for (key, load, seed), result in run_jobs(
            first.workload.trace, first.workload.format, jobs, processes, trace
        ):
            runs[key].setdefault(load, {})[seed] = result.summary["tps_within_slo"]
        for key, load in wanted.items():
            if load is not None:
                probes[key][load] = statistics.fmean(by_seed(runs[key][load]))
    return {key: knee_of({load: by_seed(v) for load, v in runs[key].items()}) for key in cells}


def by_seed(values: Mapping[int, float]) -> list[float]:
    return [values[seed] for seed in sorted(values)]
