"""The mock engine's CPU offloading at the scheduler: what it stores, evicts, announces and
gives back, and that the router's events view reads the announcements as the store is."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from smetric.core.blocks import chain_hashes
from smetric.core.kv_events import EventIndex, decode_batch
from smetric.engine.scheduler import END, EngineConfig, EngineRequest, MockEngine

BS = 16


def prompt(first: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of ``blocks`` full blocks (distinct per ``first``) and their block ids."""
    tokens = np.arange(first, first + blocks * BS, dtype=np.int64)
    return tokens, chain_hashes(tokens, BS)


async def serve(engine: MockEngine, tokens: np.ndarray, blocks: np.ndarray) -> int:
    """Run one request to its end; its cached tokens."""
    request = EngineRequest(tokens, blocks, max_tokens=1)
    engine.submit(request)
    while await request.tokens.get() is not END:
        pass
    return request.cached_tokens


def test_offloaded_blocks_are_given_back_after_the_gpu_evicted_them() -> None:
    batches: list[list[dict]] = []
    # GPU: 8 blocks; CPU: 12. A (4 blocks) then B (7) evicts A from the GPU, not the CPU.
    config = EngineConfig(speed=0.0, kv_blocks=8, block_size=BS, cpu_offload_blocks=12)
    engine = MockEngine(config, kv_sink=batches.append)
    a, b, c = prompt(0, 4), prompt(1000, 7), prompt(2000, 5)

    async def scenario() -> list[int]:
        loop = asyncio.create_task(engine.run())
        try:
            cached = [await serve(engine, *a), await serve(engine, *b)]
            assert engine.pool.cache.match(a[1]) == 0
            # A's 4 blocks come back from the CPU (3 of them: the last token is computed).
            cached.append(await serve(engine, *a))
            # C's 5 blocks overflow the CPU store (11 + 5 > 12): B's tail goes, A was read.
            cached.append(await serve(engine, *c))
            return cached
        finally:
            loop.cancel()

    cached = asyncio.run(scenario())
    assert cached == [0, 0, 3 * BS, 0]
    assert engine.counters.prefix_cache_hits == 0  # vLLM counts GPU hits only there
    assert engine.cpu is not None
    assert (engine.cpu.match(a[1]), engine.cpu.match(b[1]), engine.cpu.match(c[1])) == (4, 3, 5)
    events = [e for batch in batches for e in batch]
    cpu = [e for e in events if e["medium"] == "CPU"]
    stored = [e["block_hashes"] for e in cpu if e["type"] == "BlockStored"]
    assert stored == [a[1].tolist(), b[1].tolist(), c[1].tolist()]
    assert all(e["token_ids"] == [] and e["parent_block_hash"] is None for e in cpu[:3])
    removed = [e["block_hashes"] for e in cpu if e["type"] == "BlockRemoved"]
    assert [sorted(r) for r in removed] == [sorted(b[1][3:].tolist())]
    # The router's events view, fed the wire form, holds what the store holds.
    index = EventIndex(BS)
    for batch in batches:
        index.apply(decode_batch(msgspec.msgpack.encode([0.0, batch, 0])).events)
    assert index.unresolved == 0
    for _, blocks in (a, b, c):
        assert index.match_offloaded(blocks) == engine.cpu.match(blocks)
        assert index.match(blocks) == engine.pool.cache.match(blocks)


def test_no_offloading_by_default_and_a_negative_store_is_refused() -> None:
    assert MockEngine(EngineConfig()).cpu is None
    with pytest.raises(ValueError, match="cpu_offload_blocks"):
        EngineConfig(cpu_offload_blocks=-1)
