"""Policies that send each request to its lowest-scoring instance."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from smetric.core.policies.base import Choice, ClusterView, RoutingPolicy, RoutingRequest
from smetric.core.policies.ties import TieBreaker


@dataclass(slots=True, kw_only=True)
class Scored(RoutingPolicy):
    """The lowest score wins, ties round-robin; every decision is the one branch."""

    branch: ClassVar[str] = "score"
    _ties: TieBreaker = field(default_factory=TieBreaker, init=False, repr=False)

    @abstractmethod
    def scores(self, request: RoutingRequest, view: ClusterView) -> Sequence[float]: ...

    def route(self, request: RoutingRequest, view: ClusterView) -> Choice:
        return Choice(self._ties.argmin(self.scores(request, view)), self.branch)
