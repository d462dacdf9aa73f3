"""SMetric (paper Figure 13): balance first turns, stick sessions to their caches, guarded."""

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
class SMetric(RoutingPolicy):
    """Balance first turns, then stick each session to its cache unless a guard trips.

    The overload guard migrates a session off an instance that grew far hotter than the
    cluster mean; the eviction guard treats a follow-up whose history is mostly gone from
    every local tier as a new session. Both fall back to the same load balancing as turn 0.
    """

    name = "smetric"
    ours = True
    branches = ("first_turn_balance", "sticky", "overload_fallback", "evicted_fallback")

    overload: float = setting(
        2.0, "Move a session off an instance loaded above this multiple of the mean.", ge=0
    )
    hit_ratio: float = setting(
        0.5,
        "Treat a follow-up as new when its best local hit is at most this share of its history.",
        ge=0,
    )
    load: str = load_signal()
    _ties: TieBreaker = field(default_factory=TieBreaker, init=False, repr=False)

    def route(self, request: RoutingRequest, view: ClusterView) -> Choice:
        loads = getattr(view, self.load)
        if request.turn == 0:
            return Choice(self._ties.argmin(loads), "first_turn_balance")
        hits = view.hit_tokens
        target = best_hit(hits, loads)
        if loads[target] > self.overload * sum(loads) / len(loads):
            branch = "overload_fallback"
        elif not hits[target] > self.hit_ratio * request.est_hit_tokens:
            branch = "evicted_fallback"
        else:
            return Choice(target, "sticky")
        return Choice(self._ties.argmin(loads), branch)
