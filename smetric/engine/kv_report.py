"""One medium's prefix cache told as vLLM's KV events (map-form dicts).

The mock engine's block hashes are the router's own chained block ids. ``PrefixCache`` has
no eviction hook, so removals are found by diffing: after the cache may have shrunk, every
prefix chain reported so far is matched again and the blocks past its surviving prefix are
reported removed. That costs one ``match`` per stored chain per eviction, acceptable for a
mock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from smetric.core.prefix_cache import PrefixCache


class CacheReport:
    """Appends ``BlockStored``/``BlockRemoved`` for ``cache`` on ``medium`` to ``events``.

    ``with_tokens`` False sends stores as vLLM's ``OffloadingConnector`` does by default
    (``OffloadingConnectorScheduler.take_events``): block hashes only, no parent and no
    tokens; a consumer keys them by the GPU stores of the same hashes.
    """

    def __init__(
        self,
        cache: PrefixCache,
        medium: str,
        events: list[dict[str, Any]],
        block_size: int,
        *,
        with_tokens: bool = True,
    ) -> None:
        self.cache = cache
        self.medium = medium
        self.events = events
        self.block_size = block_size
        self.with_tokens = with_tokens
        # Blocks reported stored and not yet removed, and the chains that stored them (by
        # leaf block), which removals are diffed against.
        self._reported: set[int] = set()
        self._chains: dict[int, np.ndarray] = {}

    def stored(self, blocks: np.ndarray, token_ids: np.ndarray, start: int) -> None:
        """``BlockStored`` for ``blocks`` from ``start`` on, which the cache lacked."""
        new = blocks[start:].tolist()
        if not new:
            return
        self._reported.update(new)
        self._chains[new[-1]] = blocks
        bs = self.block_size
        event: dict[str, Any] = {"type": "BlockStored", "block_hashes": new}
        if self.with_tokens:
            event["parent_block_hash"] = int(blocks[start - 1]) if start else None
            event["token_ids"] = token_ids[start * bs : len(blocks) * bs].tolist()
        else:
            event["parent_block_hash"] = None
            event["token_ids"] = []
        event.update({"block_size": bs, "lora_id": None, "medium": self.medium})
        self.events.append(event)

    def removed(self) -> None:
        """``BlockRemoved`` for reported blocks the cache no longer holds."""
        gone: list[int] = []
        for leaf, chain in list(self._chains.items()):
            kept = self.cache.match(chain)
            if kept == len(chain):
                continue
            for block in chain[kept:].tolist():
                if block in self._reported:
                    self._reported.remove(block)
                    gone.append(block)
            del self._chains[leaf]
            if kept:
                self._chains[int(chain[kept - 1])] = chain[:kept]
        if gone:
            removed = {"type": "BlockRemoved", "block_hashes": gone, "medium": self.medium}
            self.events.append(removed)
