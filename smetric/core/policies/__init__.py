"""The routing policies: one module each, the types they share, and the one registry.

Build a ``ClusterView`` and a ``RoutingRequest``, get a policy from ``make_policy(spec)``,
and call its ``route``; feed its ``learning`` (if any) every completed request.
"""

from smetric.core.policies.base import (
    LOAD_SIGNALS,
    Choice,
    ClusterView,
    Learner,
    Learning,
    Observation,
    Policy,
    RoutingPolicy,
    RoutingRequest,
)
from smetric.core.policies.registry import (
    DEFAULT_POLICY,
    POLICIES,
    POLICY_NAMES,
    base_name,
    hardware_params,
    is_ours,
    make_policy,
    policy_params,
    resolve_policy,
    spec_params,
    split_policies,
)

__all__ = [
    "DEFAULT_POLICY",
    "LOAD_SIGNALS",
    "POLICIES",
    "POLICY_NAMES",
    "Choice",
    "ClusterView",
    "Learner",
    "Learning",
    "Observation",
    "Policy",
    "RoutingPolicy",
    "RoutingRequest",
    "base_name",
    "hardware_params",
    "is_ours",
    "make_policy",
    "policy_params",
    "resolve_policy",
    "spec_params",
    "split_policies",
]
