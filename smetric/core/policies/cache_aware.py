"""SGLang's router rule: the longest cache match unless the cluster is imbalanced."""

from __future__ import annotations

from dataclasses import dataclass, field

from smetric.core.policies.base import (
    Choice,
    ClusterView,
    RoutingPolicy,
    RoutingRequest,
    load_signal,
)
from smetric.core.policies.ties import TieBreaker, best_hit
from smetric.core.settings import setting


@dataclass(slots=True, kw_only=True)
class CacheAware(RoutingPolicy):
    """SGLang's router rule: longest match unless the cluster is already imbalanced.

    Imbalance needs both an absolute and a relative gap between the most and least loaded
    instance, so a near-idle cluster with loads 0 and 1 still counts as balanced.
    """

    name = "cache_aware"
    branches = ("imbalance_balance", "cache_hit", "low_match_balance")

    cache_threshold: float = setting(
        0.5, "Follow the longest match when it covers more than this share of the prompt.",
        ge=0, le=1.0,
    )  # fmt: skip
    balance_abs_threshold: float = setting(
        32.0, "Imbalanced when the most and least loaded differ by more than this...", ge=0
    )
    balance_rel_threshold: float = setting(
        1.0001, "...and the most loaded exceeds this multiple of the least.", ge=0
    )
    load: str = load_signal()
    _ties: TieBreaker = field(default_factory=TieBreaker, init=False, repr=False)

    def route(self, request: RoutingRequest, view: ClusterView) -> Choice:
        loads = getattr(view, self.load)
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return Choice(self._ties.argmin(loads), "imbalance_balance")
        hits = view.hit_tokens
        target = best_hit(hits, loads)
        # hit/prompt > threshold, written so that an empty prompt is simply no match.
        if hits[target] > self.cache_threshold * request.prompt_tokens:
            return Choice(target, "cache_hit")
        return Choice(self._ties.argmin(loads), "low_match_balance")
