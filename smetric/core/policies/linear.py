"""The paper's "Bailian" baseline: a weighted sum of load and cache miss."""

from __future__ import annotations

from dataclasses import dataclass

from smetric.core.policies.base import ClusterView, RoutingRequest, load_signal
from smetric.core.policies.scored import Scored
from smetric.core.settings import setting


@dataclass(slots=True, kw_only=True)
class Linear(Scored):
    """The paper's "Bailian": a weighted sum of normalised load and cache miss ratio.

    Scored as ``(1-lam)*load/max_load - lam*hit/prompt``: the paper's
    ``(1-lam)*load_norm + lam*(1 - hit/prompt)`` less the constant ``lam``, so the same order
    at two fewer operations per instance.
    """

    name = "linear"
    branches = ("score",)

    lam: float = setting(0.9, "Weight of the cache miss ratio against the load.", ge=0, le=1.0)
    load: str = load_signal()

    def scores(self, request: RoutingRequest, view: ClusterView) -> list[float]:
        loads = getattr(view, self.load)
        max_load = max(loads)
        per_load = (1.0 - self.lam) / max_load if max_load > 0 else 0.0
        prompt = request.prompt_tokens
        per_hit = self.lam / prompt if prompt > 0 else 0.0
        return [
            per_load * load - per_hit * hit
            for load, hit in zip(loads, view.hit_tokens, strict=True)
        ]
