"""Consistent hashing of sessions onto instances: sticky, blind to load."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from smetric.core.policies.base import (
    Choice,
    ClusterView,
    RoutingPolicy,
    RoutingRequest,
    load_signal,
)
from smetric.core.policies.ties import TieBreaker


def highest_random_weight(key: str, instances: Sequence[int]) -> int:
    """The position in ``instances`` of the one that wins ``key`` by rendezvous hashing.

    Each (key, instance number) pair gets a weight and the heaviest instance wins, so
    removing an instance moves only the keys it won, and adding one moves only those it
    now wins (about 1/(n+1) of them). blake2b rather than ``hash()`` so the answer is the
    same in every process, router replicas included.
    """
    base = hashlib.blake2b(key.encode(), digest_size=8)
    owner, top = 0, -1
    for position, instance in enumerate(instances):
        h = base.copy()
        h.update(instance.to_bytes(4, "little"))
        weight = int.from_bytes(h.digest(), "little")
        if weight > top:
            owner, top = position, weight
    return owner


@lru_cache(maxsize=1 << 16)
def rendezvous(key: str, n: int) -> int:
    """The owner of ``key`` among instances ``0..n-1``; memoised because a session asks
    the same question every turn."""
    return highest_random_weight(key, range(n))


@dataclass(slots=True, kw_only=True)
class SessionHash(RoutingPolicy):
    """Consistent hashing of the session key: sticky, but blind to load.

    Instances are hashed by their number among all configured instances
    (``ClusterView.instance_ids``), so an instance that leaves the view (an ejected
    engine) moves only its own sessions, and they come back when it returns.
    """

    name = "session_hash"
    branches = ("hash", "no_session_key")

    load: str = load_signal()
    _ties: TieBreaker = field(default_factory=TieBreaker, init=False, repr=False)

    def route(self, request: RoutingRequest, view: ClusterView) -> Choice:
        key = request.session_key
        if not key:
            return Choice(self._ties.argmin(getattr(view, self.load)), "no_session_key")
        ids = view.instance_ids
        if ids is None:
            return Choice(rendezvous(key, len(view.hit_tokens)), "hash")
        return Choice(highest_random_weight(key, ids), "hash")
