"""Cyclic order: the baseline that sees nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from smetric.core.policies.base import Choice, ClusterView, RoutingPolicy, RoutingRequest
from smetric.core.policies.ties import TieBreaker


@dataclass(slots=True, kw_only=True)
class RoundRobin(RoutingPolicy):
    """Cyclic order, blind to load and cache."""

    name = "round_robin"
    branches = ("round_robin",)

    _turns: TieBreaker = field(default_factory=TieBreaker, init=False, repr=False)

    def route(self, request: RoutingRequest, view: ClusterView) -> Choice:
        return Choice(self._turns.take(len(view.hit_tokens)), "round_robin")
