"""The KV-agnostic baseline: the least loaded instance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from smetric.core.policies.base import ClusterView, RoutingRequest
from smetric.core.policies.scored import Scored


@dataclass(slots=True, kw_only=True)
class LeastLoad(Scored):
    """Load balance only: vLLM's default router and the paper's KV-agnostic baseline."""

    name = "least_load"
    branch = "least_load"
    branches = ("least_load",)

    def scores(self, request: RoutingRequest, view: ClusterView) -> Sequence[float]:
        return view.load
