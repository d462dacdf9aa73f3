"""The mock engine's disaggregation roles at the scheduler: KV events from a decode pull."""

from __future__ import annotations

import numpy as np

from smetric.engine.scheduler import EngineConfig, MockEngine


def test_blocks_pulled_from_a_prefill_engine_are_cached_pinned_and_announced() -> None:
    events: list[dict] = []
    engine = MockEngine(EngineConfig(kv_blocks=8, block_size=4), kv_sink=events.extend)
    tokens = np.arange(20)
    blocks = np.array([11, 12, 13, 14, 15], dtype=np.int64)
    handle = engine.adopt(tokens, blocks, 3, now=0.0)
    assert handle is not None
    assert engine.pool.cache.match(blocks) == 3 and engine.pool.cache.locked == 3
    (stored,) = events
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [11, 12, 13]
    assert stored["token_ids"] == list(range(12)) and stored["parent_block_hash"] is None
    # No room for more than the pool: the request computes them instead.
    assert engine.adopt(np.arange(40), np.arange(100, 110), 10, now=1.0) is None
    engine.pool.cache.unlock(handle, 2.0)
    assert engine.pool.cache.locked == 0 and engine.pool.private == 0
