"""Balance potential (the paper's Figure 9): can this workload's tokens be spread evenly?

Requests are replayed in arrival order on ``instances`` simulated instances, each sent to
the instance holding the fewest in-flight tokens (prefill and decode tokens of the
requests it is running), where it stays for its execution time. Per time window, the
imbalance is the busiest instance's mean in-flight tokens over the mean across instances.
This is the paper's approximation: no queueing, no caching, just the workload's shape.

The imbalance figures leave out the ramp-up: the leading windows before the cluster's load
first reaches half its median level, while sessions are still starting and a few long
ones cannot be spread over all instances whatever the dispatch. The heatmap keeps every
window.
"""

from __future__ import annotations

import heapq

import numpy as np

from smetric.trace.analysis.results import (
    Arrivals,
    Balance,
    Durations,
    ImbalanceStats,
    RateStats,
)


def least_tokens_dispatch(
    arrival_s: np.ndarray, duration_s: np.ndarray, tokens: np.ndarray, instances: int
) -> np.ndarray:
    """Instance chosen for each request (in the order given, arrivals non-decreasing)."""
    load = np.zeros(instances, dtype=np.float64)
    running: list[tuple[float, int, int]] = []
    chosen = np.empty(len(arrival_s), dtype=np.int64)
    for r in range(len(arrival_s)):
        now = arrival_s[r]
        while running and running[0][0] <= now:
            _, instance, done = heapq.heappop(running)
            load[instance] -= tokens[done]
        instance = int(np.argmin(load))
        chosen[r] = instance
        load[instance] += tokens[r]
        heapq.heappush(running, (now + duration_s[r], instance, r))
    return chosen


def window_loads(
    start_s: np.ndarray,
    end_s: np.ndarray,
    tokens: np.ndarray,
    instance: np.ndarray,
    instances: int,
    edges: np.ndarray,
) -> np.ndarray:
    """Mean in-flight tokens per instance and window (instances x windows).

    The integral of a step function is piecewise linear between its change points, so
    interpolating the running integral at the window edges is exact.
    """
    loads = np.zeros((instances, len(edges) - 1))
    for i in range(instances):
        mine = instance == i
        if not mine.any():
            continue
        times = np.concatenate([start_s[mine], end_s[mine]])
        deltas = np.concatenate([tokens[mine], -tokens[mine]]).astype(np.float64)
        order = np.argsort(times, kind="stable")
        times, deltas = times[order], deltas[order]
        level = np.cumsum(deltas)
        area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])
        integral = np.interp(edges, times, area, left=0.0, right=area[-1])
        loads[i] = np.diff(integral) / np.diff(edges)
    return loads


def balance_potential(
    arrival_s: np.ndarray,
    duration_s: np.ndarray,
    tokens: np.ndarray,
    instances: int,
    window_s: float,
    until_s: float | None = None,
    arrivals: Arrivals = "recorded",
    durations: Durations = "recorded",
) -> Balance:
    """Windows run from the first arrival to the last, or to ``until_s`` when given;
    ``arrivals`` and ``durations`` say where the times came from, for the result."""
    order = np.argsort(arrival_s, kind="stable")
    arrival_s, duration_s, tokens = arrival_s[order], duration_s[order], tokens[order]
    chosen = least_tokens_dispatch(arrival_s, duration_s, tokens, instances)
    t0 = float(arrival_s[0])
    end = float(arrival_s[-1]) if until_s is None else until_s
    windows = max(1, int(np.ceil((end - t0) / window_s)))
    edges = t0 + window_s * np.arange(windows + 1)
    loads = window_loads(arrival_s, arrival_s + duration_s, tokens, chosen, instances, edges)
    ramp = ramp_up_windows(loads)
    measured = loads[:, ramp:]
    mean = measured.mean(axis=0)
    busy = mean > 0
    imbalance = measured.max(axis=0)[busy] / mean[busy]
    per_window = np.histogram(arrival_s, bins=edges)[0] / instances * (60.0 / window_s)
    if not len(imbalance):  # no busy window: figures of zero, not of an empty series
        imbalance = np.zeros(1)
    return Balance(
        instances=instances,
        window_s=window_s,
        ramp_up_windows=ramp,
        requests_per_min_per_instance=RateStats(
            mean=float(per_window.mean()),
            min=float(per_window.min()),
            max=float(per_window.max()),
            series=per_window.tolist(),
        ),
        imbalance=ImbalanceStats(
            mean=float(imbalance.mean()),
            p50=float(np.percentile(imbalance, 50)),
            p90=float(np.percentile(imbalance, 90)),
            max=float(imbalance.max()),
            series=imbalance.tolist(),
        ),
        heatmap=loads.tolist(),
        arrivals=arrivals,
        durations=durations,
    )


def ramp_up_windows(loads: np.ndarray) -> int:
    """Leading windows before the cluster's mean load first reaches half its median over
    the busy windows."""
    mean = loads.mean(axis=0)
    busy = mean[mean > 0]
    if not len(busy):
        return 0
    return int(np.flatnonzero(mean >= np.median(busy) / 2)[0])
