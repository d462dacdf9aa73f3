"""KV events from the mock engine to a subscriber's ``EventIndex``, over ZMQ on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import numpy as np
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from smetric.core.blocks import ByteTokenizer, chain_hashes
from smetric.core.conversation import Api, analyze_request
from smetric.core.kv_events import EventIndex
from smetric.engine import EngineConfig, KVEventPublisher, create_app
from smetric.engine.server import KV_EVENTS
from smetric.serve.engines import Engine
from smetric.serve.kv_subscriber import KVEventSubscriber

from conftest import block_stored, until_heard

BS = 16
SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 6}
_TOKENIZER = ByteTokenizer()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def blocks(body: dict[str, Any], api: Api) -> np.ndarray:
    return analyze_request(body, api, _TOKENIZER, BS).blocks


async def settle(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def subscriber(
    index: EventIndex, endpoint: str, topic: str, replay: str | None
) -> AsyncIterator[KVEventSubscriber]:
    sub = KVEventSubscriber(index, endpoint, topic, replay)
    await sub.start()
    try:
        yield sub
    finally:
        await sub.close()


async def post(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    return await response.json()


def cached(reply: dict[str, Any]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_events_view_predicts_the_engines_hits_and_restarts_clear_it() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(
        speed=0.001,
        kv_blocks=64,
        kv_events_endpoint=endpoint,
        kv_events_topic="kv-a",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
    )

    async def main() -> None:
        index = EventIndex(BS)
        async with subscriber(index, endpoint, "kv-a", config.kv_events_replay_endpoint) as sub:
            app = create_app(config)
            publisher = app[KV_EVENTS]

            async def synced(body: dict[str, Any], path: str) -> dict[str, Any]:
                reply = await post(client, path, body)
                await settle(lambda: sub.tracker.last == publisher.seq - 1)
                return reply

            async def warm_up(attempt: int) -> None:
                await post(client, "/v1/completions", {"prompt": f"hello {attempt} " * 8})

            async with TestClient(TestServer(app)) as client:
                start = sub.counters.batches
                await until_heard(warm_up, lambda: sub.counters.batches > start)
                first = [SYSTEM, {"role": "user", "content": "List the files in src/."}]
                body = {"messages": first, "max_tokens": 4}
                one = await synced(body, "/v1/chat/completions")
                assert index.match(blocks(body, "chat")) == len(blocks(body, "chat"))

                answer = {"role": "assistant", "content": one["choices"][0]["message"]["content"]}
                second = {"messages": [*first, answer, {"role": "user", "content": "Go on."}]}
                facts = analyze_request(second, "chat", _TOKENIZER, BS)
                view = Engine(str(client.make_url("")), config.kv_blocks, events=index)
                predicted = view.predicted_hit(facts.blocks, BS, facts.prompt_tokens)
                assert predicted == index.match(facts.blocks) * BS > 0
                assert cached(await synced(second, "/v1/chat/completions")) == predicted

                # Evictions: the pool holds 64 blocks, each prompt takes 19.
                old = {"prompt": "o" * 300, "max_tokens": 4}
                await synced(old, "/v1/completions")
                assert index.match(blocks(old, "completions")) == 300 // BS
                for letter in "abcdefgh":
                    await synced({"prompt": letter * 300, "max_tokens": 4}, "/v1/completions")
                assert index.match(blocks(old, "completions")) == 0
                assert cached(await synced(old, "/v1/completions")) == 0
                assert sub.exact and sub.counters.unrecovered == 0

            # A new engine process numbers its batches from 0 again.
            app = create_app(config)
            publisher = app[KV_EVENTS]
            async with TestClient(TestServer(app)) as client:
                start = sub.counters.batches
                await until_heard(warm_up, lambda: sub.counters.batches > start)
                fresh = {"prompt": "z" * 100, "max_tokens": 4}
                await synced(fresh, "/v1/completions")
                assert sub.counters.restarts == 1
                assert index.match(blocks(old, "completions")) == 0
                assert index.match(blocks(fresh, "completions")) == 100 // BS
                assert sub.exact

    asyncio.run(main())


def _batches() -> tuple[list[int], list[list[dict[str, Any]]]]:
    """Three batches storing one block each, chained, so a missed one orphans the next."""
    tokens = list(range(3 * BS))
    blocks = [tokens[i * BS : (i + 1) * BS] for i in range(3)]
    return tokens, [[block_stored([i + 1], i or None, blocks[i], BS)] for i in range(3)]


def _frames(seq: int, events: list[dict[str, Any]]) -> list[bytes]:
    payload = msgspec.msgpack.encode([0.0, events, 0])
    return [b"kv", seq.to_bytes(8, "big"), payload]


def test_a_gap_is_filled_from_replay_in_order() -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    config = EngineConfig(
        kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",  # nobody listens: all dropped
        kv_events_replay_endpoint=replay,
    )
    tokens, batches = _batches()
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        publisher = KVEventPublisher(config)
        async with contextlib.asynccontextmanager(publisher.serve)(web.Application()):
            for events in batches:
                publisher.publish(events)
            index = EventIndex(BS)
            async with subscriber(index, f"tcp://127.0.0.1:{free_port()}", "kv", replay) as sub:
                await sub.receive(_frames(0, batches[0]))
                await sub.receive(_frames(2, batches[2]))  # batch 1 was lost on the way
                assert index.match(keys) == 3
                assert sub.exact
                assert sub.counters.gaps == 1
                assert sub.counters.replayed == 1
                assert sub.counters.duplicates == 1  # the replay resends batch 2 too
                assert sub.counters.batches == 3

                # Joining late asks for the history from batch 0.
                late = EventIndex(BS)
                async with subscriber(late, f"tcp://127.0.0.1:{free_port()}", "kv", replay) as s:
                    await s.receive(_frames(2, batches[2]))
                    assert late.match(keys) == 3
                    assert s.exact and s.counters.replayed == 2

    asyncio.run(main())


def test_an_unfilled_gap_or_bad_payload_makes_the_view_inexact_until_a_restart(caplog) -> None:
    tokens, batches = _batches()
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        index = EventIndex(BS)
        async with subscriber(index, f"tcp://127.0.0.1:{free_port()}", "kv", None) as sub:
            await sub.receive(_frames(0, batches[0]))
            await sub.receive(_frames(2, batches[2]))
            assert not sub.exact
            assert sub.counters.unrecovered == 1
            assert index.match(keys) == 1 and index.orphaned == 1

            await sub.receive(_frames(0, batches[0]))  # a restarted engine
            assert sub.exact and sub.counters.restarts == 1
            assert index.match(keys) == 1 and index.size() == 1

            await sub.receive([b"kv", (1).to_bytes(8, "big"), b"\xc1"])
            assert not sub.exact and sub.counters.decode_errors == 1

    with caplog.at_level("WARNING", logger="smetric.serve"):
        asyncio.run(main())
    # Each change of state is logged once, as a JSON line the operator can grep.
    events = [json.loads(r.getMessage())["event"] for r in caplog.records]
    assert events == ["kv_view_degraded", "kv_events_restart", "kv_view_degraded"]
