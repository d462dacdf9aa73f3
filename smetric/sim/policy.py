"""The policy a simulated cluster routes with, its hardware rates derived from the cluster."""

from __future__ import annotations

from smetric.core.policies import Learning, RoutingPolicy, make_policy, resolve_policy, spec_params
from smetric.model.calibrate import hardware_rates
from smetric.model.perf import kv_bytes_per_token, load_model
from smetric.sim.cluster import instances_per_server, lane_gb_s, step_time_model
from smetric.sim.config import ClusterConfig, nominal


def cluster_rates(cluster: ClusterConfig) -> dict[str, float]:
    """The hardware rates of one instance of ``cluster`` (``model.calibrate``), its fetches
    over the slower of its own lane (PCIe, capped by the medium's connector rate) and its
    share of its server's NICs (all GPUs of a full server fetching at once).

    They are derived from the nominal cluster: a perturbed world's policy is not told.
    """
    cluster = nominal(cluster)
    nic_share = cluster.nics_per_server * cluster.nic_gb_s / instances_per_server(cluster)
    pcie = lane_gb_s(cluster)
    kv_bytes = kv_bytes_per_token(load_model(cluster.model), cluster.kv_dtype)
    rates = hardware_rates(
        step_time_model(cluster),
        cluster.max_num_batched_tokens,
        min(nic_share, pcie) * 1e9,
        kv_bytes,
    )
    return rates.by_name()


def cluster_policy(spec: str, cluster: ClusterConfig) -> tuple[RoutingPolicy, dict[str, float]]:
    """The policy a simulated cluster routes with, and the value of each of its parameters:
    the spec's, else derived from the cluster where the policy depends on the hardware.

    Where the policy balances load, it balances requests in flight, or under PD
    disaggregation the prefill instances' unprefilled prompt tokens (Figure 13, line 29).
    """
    rates = cluster_rates(cluster)
    load = "unprefilled_tokens" if cluster.prefill_instances else "inflight_requests"
    return make_policy(spec, rates, load), resolve_policy(spec, rates)[1]


def policy_learning(router: RoutingPolicy, spec: str) -> Learning | None:
    """What learns the parameters the spec leaves open, if the policy learns any."""
    return router.learning(spec_params(spec)[1])


def learned_summary(learning: Learning | None) -> dict:
    """What a run learned, for its summary: the final values and from how many
    completed requests (nothing for a policy that learns nothing)."""
    if learning is None:
        return {}
    learner = learning.learner
    return {"learned_params": dict(learner.learned()), "learned_from": learner.observed}
