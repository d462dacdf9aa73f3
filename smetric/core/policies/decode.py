"""How a disaggregated cluster picks the decode instance for a prefilled request.

The simulator and the live router build the same ``DecodeView`` and call the same rule,
so the two drivers choose alike. A rule answers with a ``Choice`` naming its branch, as
the routing policies do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from smetric.core.errors import ConfigError
from smetric.core.policies.base import Choice
from smetric.core.policies.ties import TieBreaker


@dataclass(frozen=True, slots=True)
class DecodeView:
    """Per decode instance, indexed alike."""

    # Requests in flight on the instance (queued, loading or decoding).
    inflight_requests: Sequence[int]
    # Share of the instance's KV blocks that its requests hold or have claimed, in [0, 1];
    # None where the driver does not know it now (the router's scrape is stale or missing).
    kv_used_fraction: Sequence[float | None]


class DecodePolicy(ABC):
    """A deterministic map from a decode view to a decode instance."""

    name: ClassVar[str]
    branches: ClassVar[tuple[str, ...]]
    __slots__ = ("_ties",)

    def __init__(self) -> None:
        self._ties = TieBreaker()

    @abstractmethod
    def choose(self, view: DecodeView) -> Choice: ...


class LeastKV(DecodePolicy):
    """The instance with the least KV in use, ties round-robin.

    Where any instance's KV share is unknown, every instance is compared by its requests
    in flight instead, so one argmin never compares a share with a count.
    """

    name = "least_kv"
    branches = ("least_kv", "least_requests_fallback")
    __slots__ = ()

    def choose(self, view: DecodeView) -> Choice:
        known = [used for used in view.kv_used_fraction if used is not None]
        if len(known) < len(view.kv_used_fraction):
            counts = [float(n) for n in view.inflight_requests]
            return Choice(self._ties.argmin(counts), "least_requests_fallback")
        return Choice(self._ties.argmin(known), "least_kv")


class LeastRequests(DecodePolicy):
    """The instance with the fewest requests in flight, ties round-robin."""

    name = "least_requests"
    branches = ("least_requests",)
    __slots__ = ()

    def choose(self, view: DecodeView) -> Choice:
        counts = [float(n) for n in view.inflight_requests]
        return Choice(self._ties.argmin(counts), "least_requests")


class RoundRobinDecode(DecodePolicy):
    """Cyclic order, blind to load."""

    name = "round_robin"
    branches = ("round_robin",)
    __slots__ = ()

    def choose(self, view: DecodeView) -> Choice:
        return Choice(self._ties.take(len(view.inflight_requests)), "round_robin")


DECODE_POLICIES: dict[str, type[DecodePolicy]] = {
    cls.name: cls for cls in (LeastKV, LeastRequests, RoundRobinDecode)
}
DECODE_POLICY_NAMES: tuple[str, ...] = tuple(DECODE_POLICIES)
DEFAULT_DECODE_POLICY = "least_kv"


def make_decode_policy(name: str) -> DecodePolicy:
    """A fresh decode policy by name."""
    try:
        return DECODE_POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"decode policy {name!r}: use one of {', '.join(DECODE_POLICY_NAMES)}"
        ) from None
