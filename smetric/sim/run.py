"""One simulation run end to end: trace + configuration + policy -> per-request table and
summary. Pure apart from reading the trace, so runs can go to worker processes."""

from __future__ import annotations

from collections.abc import Callable

from smetric.sim.cluster import Simulation
from smetric.sim.config import SimConfig
from smetric.sim.pd import DisaggSimulation
from smetric.sim.policy import cluster_policy, policy_learning
from smetric.sim.result import RunResult, with_simulated
from smetric.sim.workload import build_workload
from smetric.trace.schema import Trace


def simulate(
    trace: Trace,
    config: SimConfig,
    policy: str,
    progress: Callable[[float], None] | None = None,
) -> RunResult:
    """One run of ``policy``: on a colocated cluster, or a disaggregated one
    (``sim.pd``) where the cluster has prefill instances; each scores its own table."""
    workload = build_workload(trace, config.workload)
    router, params = cluster_policy(policy, config.cluster)
    learning = policy_learning(router, policy)
    kind = DisaggSimulation if config.cluster.prefill_instances else Simulation
    sim = kind(config.cluster, router, workload, progress, learning)
    table, summary = sim.scored(sim.run(), config)
    # Only the routed instances read and write the global tier.
    summary = with_simulated(summary, sim.instances[: sim.routed], sim.instances, learning)
    return RunResult(policy, table, summary, sim.shape, params)
