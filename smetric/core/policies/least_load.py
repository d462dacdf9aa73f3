"""The KV-agnostic baseline: the least loaded instance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from smetric.core.policies.base import ClusterView, RoutingRequest, load_signal
from smetric.core.policies.scored import Scored


@dataclass(slots=True, kw_only=True)
class LeastLoad(Scored):
    """Load balance only: vLLM's default router and the paper's KV-agnostic baseline."""

    name = "least_load"
    branch = "least_load"
    branches = ("least_load",)

    load: str = load_signal()

    def scores(self, request: RoutingRequest, view: ClusterView) -> Sequence[float]:
        loads: Sequence[float] = getattr(view, self.load)
        return loads
