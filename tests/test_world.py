"""Perturbed worlds seen by the price learner, and the free global tier of the ceilings."""

from __future__ import annotations

import math

from smetric.core.policies.smetric_cost import SMetricCost
from smetric.eval.grid import FREE_GLOBAL_TIER
from smetric.sim.cluster import routes
from smetric.sim.config import ClusterConfig, SimConfig
from smetric.sim.run import simulate
from smetric.trace.load import load_trace


def test_the_free_global_tier_moves_kv_in_no_time() -> None:
    config = ClusterConfig(instances=8, global_medium="mooncake-rdma")
    route = routes(ClusterConfig(**{**config.__dict__, **FREE_GLOBAL_TIER}))[0]
    assert math.isinf(route.pcie.bytes_per_s) and math.isinf(route.nic.bytes_per_s)
    assert route.transfer(5.0, 1e12) == 5.0


def test_the_learner_finds_a_slower_prefill_the_policy_was_not_told_of() -> None:
    """Same cluster, same requests: with every prefill 1.5x slower the learned prices put
    a 30 k-token prefill dearer than in the configured world."""
    trace = load_trace("sample:weka")
    config = (
        SimConfig()
        .override("cluster", instances=2, global_capacity="full")
        .override("workload", session_rate=0.02, duration_s=900.0)
    )
    slow = config.override("cluster", prefill_slowdown=1.5)

    def prefill_s(run: SimConfig) -> float:
        learned = simulate(trace, run, "smetric_cost").summary.learned_params
        assert learned is not None
        return SMetricCost(**learned).prefill_s(30_000)

    assert prefill_s(slow) > 1.2 * prefill_s(config)
