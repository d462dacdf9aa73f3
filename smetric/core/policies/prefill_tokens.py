"""Dynamo's rule: the fewest unprefilled tokens after taking this request."""

from __future__ import annotations

from dataclasses import dataclass

from smetric.core.policies.base import ClusterView, RoutingRequest
from smetric.core.policies.scored import Scored


@dataclass(slots=True, kw_only=True)
class PrefillTokens(Scored):
    """Dynamo: the fewest unprefilled tokens the instance would hold after taking this one."""

    name = "prefill_tokens"
    branches = ("score",)

    def scores(self, request: RoutingRequest, view: ClusterView) -> list[float]:
        prompt = request.prompt_tokens
        return [
            queued + (prompt - hit)
            for queued, hit in zip(view.unprefilled_tokens, view.hit_tokens, strict=True)
        ]
