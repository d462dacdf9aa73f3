"""What the router knows of the cluster's global KV tier: ``ClusterView.global_hit_tokens``.

The paper's global tier is one cluster-wide pool (CPU memory) that any instance can load
a prefix from, so a session moved off its instance costs a fetch there rather than a
recompute. The router learns what it holds from one of two sources (``--global-tier``):

- ``events``: engines that offload KV (vLLM's ``OffloadingConnector``, LMCache) announce
  the blocks they copy to CPU memory or storage in their KV events, with a medium other
  than ``"GPU"`` (``core/kv_events``). The global hit is the longest prefix that any
  engine's offload media hold: the max over engines, reading those media as one shared
  store. That is what the paper's tier is, and what a shared store (LMCache with a
  remote backend) gives; with vLLM's CPU offloading, where each engine's CPU memory is
  its own, it overstates what another engine could load.
- ``full``: a store that publishes nothing, assumed to keep every prompt the cluster has
  prefilled; the router's record of the prompts engines answered stands for it, the same
  ``model.kv.GlobalTier`` the simulator writes at each completed prefill, unbounded or
  bounded in tokens (least recently used first out).

``none`` (the default) leaves the hit unknown (None), as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from smetric.core.errors import ConfigError
from smetric.model.kv import GlobalTier
from smetric.serve.engines import Engine

GLOBAL_TIERS = ("none", "events", "full")


class GlobalTierView(Protocol):
    def match(self, blocks: np.ndarray) -> int:
        """Leading blocks of ``blocks`` the global tier holds."""
        ...

    def record(self, blocks: np.ndarray) -> None:
        """An engine has prefilled this prompt."""
        ...


class OffloadEvents:
    """The offload media that engines' KV events describe, read as one shared store."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.indexes = [e.events for e in engines if e.events is not None]
        if not self.indexes:
            raise ConfigError(
                "--global-tier events needs an engine with kv_events in --config "
                "(engines that offload report their CPU blocks there)"
            )

    def match(self, blocks: np.ndarray) -> int:
        return max(index.match_offloaded(blocks) for index in self.indexes)

    def record(self, blocks: np.ndarray) -> None:
        """Nothing to do: the engines' events say what they offloaded."""


class ServedPrompts:
    """Every prompt an engine prefilled, as a global tier that keeps them would hold.

    ``on_record`` passes each recorded prompt on (to the other router workers, which
    ``learn`` it), so every worker holds what all of them served.
    """

    def __init__(self, capacity_blocks: int | None) -> None:
        self.tier = GlobalTier(capacity_blocks)
        self.on_record: Callable[[np.ndarray], None] | None = None

    def match(self, blocks: np.ndarray) -> int:
        return self.tier.match(blocks)

    def record(self, blocks: np.ndarray) -> None:
        self.learn(blocks)
        if self.on_record is not None:
            self.on_record(blocks)

    def learn(self, blocks: np.ndarray) -> None:
        self.tier.write(blocks, time.monotonic())


def global_tier_from(
    kind: str, capacity_tokens: int, block_size: int, engines: Sequence[Engine]
) -> GlobalTierView | None:
    """The view ``--global-tier`` names; ``capacity_tokens`` bounds ``full`` (0: never
    evicts)."""
    if kind not in GLOBAL_TIERS:
        raise ConfigError(f"unknown global tier {kind!r}; one of {', '.join(GLOBAL_TIERS)}")
    if capacity_tokens < 0:
        raise ConfigError(f"the global tier's capacity must be >= 0 tokens, got {capacity_tokens}")
    if capacity_tokens and kind != "full":
        raise ConfigError("a global-tier capacity in tokens applies to --global-tier full only")
    if kind == "events":
        return OffloadEvents(engines)
    if kind == "full":
        if 0 < capacity_tokens < block_size:
            raise ConfigError(f"a global tier of {capacity_tokens} tokens holds no block")
        return ServedPrompts(capacity_tokens // block_size or None)
    return None
