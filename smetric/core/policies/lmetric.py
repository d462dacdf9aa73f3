"""LMetric: the prefill work left after reuse, weighted by the instance's load."""

from __future__ import annotations

from dataclasses import dataclass

from smetric.core.policies.base import ClusterView, RoutingRequest, load_signal
from smetric.core.policies.scored import Scored


@dataclass(slots=True, kw_only=True)
class LMetric(Scored):
    """LMetric: prefill work left after reuse times (load + 1), with no weight to tune."""

    name = "lmetric"
    branches = ("score",)

    load: str = load_signal()

    def scores(self, request: RoutingRequest, view: ClusterView) -> list[float]:
        prompt = request.prompt_tokens
        return [
            (prompt - hit) * (load + 1)
            for hit, load in zip(view.hit_tokens, getattr(view, self.load), strict=True)
        ]
