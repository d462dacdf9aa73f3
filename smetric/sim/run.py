"""One simulation run end to end: trace + configuration + policy -> per-request table and
summary. Pure apart from reading the trace, so runs can go to worker processes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from smetric.core.policies import Policy, spec_params
from smetric.core.prices import PriceLearner, price_learner
from smetric.metrics.summary import summarize, with_latencies
from smetric.sim.cluster import ClusterShape, Simulation
from smetric.sim.config import SimConfig
from smetric.sim.policy import cluster_policy
from smetric.sim.workload import build_workload
from smetric.trace.schema import Trace


@dataclass(frozen=True)
class RunResult:
    policy: str
    requests: pl.DataFrame
    summary: dict
    shape: ClusterShape
    # Every parameter the policy ran with, hardware-derived ones included (model/calibrate.py).
    policy_params: dict[str, float]


def simulate(
    trace: Trace,
    config: SimConfig,
    policy: str,
    progress: Callable[[float], None] | None = None,
) -> RunResult:
    if config.cluster.prefill_instances:
        from smetric.sim.pd import simulate_disaggregated

        return simulate_disaggregated(trace, config, policy, progress)
    workload = build_workload(trace, config.workload)
    router, params = cluster_policy(policy, config.cluster)
    learner = policy_learner(router, policy)
    sim = Simulation(config.cluster, router, workload, progress, learner)
    horizon = workload.horizon_s
    table = with_latencies(sim.run(), config.slo, horizon)
    summary = summarize(
        table, config.slo, horizon, config.cluster.instances, config.window_s, config.warmup_s
    )
    summary["global_tier_bytes"] = sum(i.route.bytes_moved for i in sim.instances)
    summary["busy_fraction"] = [i.busy_time / horizon for i in sim.instances]
    summary.update(learned_summary(learner))
    return RunResult(policy, table, summary, sim.shape, params)


def policy_learner(router: Policy, spec: str) -> PriceLearner | None:
    """The learner of the prices the spec leaves open, if the policy learns any."""
    return price_learner(router, spec_params(spec)[1])


def learned_summary(learner: PriceLearner | None) -> dict:
    """What a run learned, for its summary: the final estimates and from how many
    completed requests (nothing for a policy that learns nothing)."""
    if learner is None:
        return {}
    return {"learned_params": learner.learned(), "learned_from": learner.observed}
