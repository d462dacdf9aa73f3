"""What the router knows of each engine: health, load, and an approximate KV view.

The KV view is the router's own prefix index: the blocks of every request it sent to the
engine, bounded by the engine's KV capacity and evicted least recently used, the same
``PrefixCache`` the simulator uses for a GPU pool. It never asks the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from smetric.core.prefix_cache import PrefixCache


@dataclass
class Engine:
    url: str
    kv_blocks: int
    healthy: bool = True
    # Requests routed here whose response has not ended: the load the policy sees.
    inflight: int = 0
    index: PrefixCache = field(init=False)
    failures: int = 0

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.index = PrefixCache(self.kv_blocks)

    def predicted_hit(self, blocks: np.ndarray, block_size: int, prompt_tokens: int) -> int:
        """Tokens this engine should find cached: whole blocks, never the whole prompt."""
        return min(self.index.match(blocks) * block_size, max(prompt_tokens - 1, 0))

    def remember(self, blocks: np.ndarray) -> None:
        """The engine now caches this prompt (as vLLM does after the prefill)."""
        self.index.insert(blocks, time.monotonic())

    def forget(self) -> None:
        """An engine that went away lost its cache."""
        self.index = PrefixCache(self.kv_blocks)
