"""What every driver (simulator, live router, mock engine) must agree on; no I/O here.

The routing API is re-exported here: build a ``ClusterView`` and a ``RoutingRequest``, get a
policy from ``make_policy(spec)``, and call its ``route``.
"""

from smetric.core.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    Choice,
    ClusterView,
    Policy,
    RoutingRequest,
    make_policy,
    policy_params,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Choice",
    "ClusterView",
    "Policy",
    "RoutingRequest",
    "make_policy",
    "policy_params",
]
