"""One simulation run end to end: trace + configuration + policy -> per-request table and
summary. Pure apart from reading the trace, so runs can go to worker processes."""

from __future__ import annotations

from collections.abc import Callable

from smetric.metrics.summary import summarize, with_latencies
from smetric.sim.cluster import Simulation
from smetric.sim.config import SimConfig
from smetric.sim.pd import simulate_disaggregated
from smetric.sim.policy import cluster_policy, learned_summary, policy_learning
from smetric.sim.result import RunResult
from smetric.sim.workload import build_workload
from smetric.trace.schema import Trace


def simulate(
    trace: Trace,
    config: SimConfig,
    policy: str,
    progress: Callable[[float], None] | None = None,
) -> RunResult:
    if config.cluster.prefill_instances:
        return simulate_disaggregated(trace, config, policy, progress)
    workload = build_workload(trace, config.workload)
    router, params = cluster_policy(policy, config.cluster)
    learning = policy_learning(router, policy)
    sim = Simulation(config.cluster, router, workload, progress, learning)
    horizon = workload.horizon_s
    table = with_latencies(sim.run(), config.slo, horizon)
    summary = summarize(
        table, config.slo, horizon, config.cluster.instances, config.window_s, config.warmup_s
    )
    summary["global_tier_bytes"] = sum(i.tier_route.bytes_moved for i in sim.instances)
    summary["busy_fraction"] = [i.busy_time / horizon for i in sim.instances]
    summary.update(learned_summary(learning))
    return RunResult(policy, table, summary, sim.shape, params)
