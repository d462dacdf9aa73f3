"""A policy's hardware constants, derived from the cluster the simulator simulates.

``smetric_cost`` prices queueing, recompute and fetch in seconds, so its constants belong
to the hardware: an H200 prefills about 7x faster than an H20 while a fetch over the
same NICs is only as fast as the KV dtype lets it be, and H20 constants would misprice
every move there. An operator sets them in the policy spec for their engines; the
simulator knows its own hardware and derives them here from the same perf model and
links it simulates, the way the policy's defaults were derived for one H20.

Each value is rounded to two significant digits (prefill rate three): they are estimates
of a cost rule, and rounded they are the policy's defaults exactly for the default
cluster, so every result measured with those defaults stands.
"""

from __future__ import annotations

from smetric.core.policy import Policy, make_policy, resolve_policy
from smetric.sim.cluster import instances_per_server, lane_gb_s, step_time_model
from smetric.sim.config import ClusterConfig, nominal
from smetric.sim.perf import kv_bytes_per_token, load_model

# The context depth at which the prefill rate is read to fit the attention term.
_DEEP_CONTEXT_TOKENS = 100_000


def _significant(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


def policy_constants(cluster: ClusterConfig) -> dict[str, float]:
    """``smetric_cost``'s hardware constants for one instance of ``cluster``.

    - ``prefill_tps``: the rate of a full chunk (``max_num_batched_tokens``) with no
      context before it;
    - ``attn_tokens``: the context at which attention costs a token as much as the rest,
      fitted so that ``(1 + c / attn_tokens) / prefill_tps`` is a chunk's time per token
      after ``c`` = 100 k tokens of context;
    - ``kv_read_s``: what a decode step spends per token of KV it reads;
    - ``fetch_tps``: tokens of KV a second over the slower of the instance's own lane
      (PCIe, capped by the medium's connector rate) and its share of its server's NICs
      (all GPUs of a full server fetching at once).

    They are derived from the nominal cluster: a perturbed world's policy is not told.
    """
    cluster = nominal(cluster)
    perf = step_time_model(cluster)
    chunk = cluster.max_num_batched_tokens
    fresh_tps = chunk / perf.step_time(chunk, chunk * chunk / 2, 0, 0)
    deep_context = chunk * (_DEEP_CONTEXT_TOKENS + chunk / 2)
    deep_tps = chunk / perf.step_time(chunk, deep_context, 0, 0)
    attn_tokens = _DEEP_CONTEXT_TOKENS / (fresh_tps / deep_tps - 1.0)
    nic_share = cluster.nics_per_server * cluster.nic_gb_s / instances_per_server(cluster)
    pcie = lane_gb_s(cluster)
    kv_bytes = kv_bytes_per_token(load_model(cluster.model), cluster.kv_dtype)
    fetch_tps = min(nic_share, pcie) * 1e9 / kv_bytes
    return {
        "prefill_tps": _significant(fresh_tps, 3),
        "attn_tokens": _significant(attn_tokens, 2),
        "kv_read_s": _significant(perf.kv_token_s, 2),
        "fetch_tps": _significant(fetch_tps, 2),
    }


def cluster_policy(spec: str, cluster: ClusterConfig) -> tuple[Policy, dict[str, float]]:
    """The policy a simulated cluster routes with, and the value of each of its parameters:
    the spec's, else derived from the cluster where the policy depends on the hardware."""
    derived = policy_constants(cluster)
    return make_policy(spec, derived), resolve_policy(spec, derived)[1]
