"""KV events from the mock engine to a subscriber's ``EventIndex``, over ZMQ on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest

from smetric.core.blocks import ByteTokenizer, chain_hashes
from smetric.core.conversation import Api, analyze_request
from smetric.core.kv_events import EventIndex
from smetric.engine import EngineConfig, KVEventPublisher, create_app
from smetric.engine.server import KV_EVENTS
from smetric.serve.app import Router, RouterSettings
from smetric.serve.config import ServeConfig, engines_from, load_config
from smetric.serve.engines import Engine
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.metrics import SubscriberCollector
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.ports import startup_events_ports

from conftest import block_stored, closed_port, events_engine, until_heard

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

BS = 16
SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 6}
_TOKENIZER = ByteTokenizer()


# What a socket binds when the test needs no fixed address: a loopback port the OS picks,
# read back from the socket (``endpoint``, ``replay_endpoint``) by whoever connects.
ANY = "tcp://127.0.0.1:*"


def blocks(body: dict[str, Any], api: Api) -> np.ndarray:
    return analyze_request(body, api, _TOKENIZER, BS).blocks


def view_of(engine: Engine) -> EventIndex:
    """The engine's view of its cache, from the KV events it publishes."""
    assert engine.events is not None, f"{engine.url} publishes no KV events"
    return engine.events


def past(count: Callable[[], int], since: int) -> Callable[[], bool]:
    """Whether ``count()`` has gone past ``since``."""
    return lambda: count() > since


async def settle(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def subscriber(
    index: EventIndex, endpoint: str, topic: str, replay: str | None, **options: Any
) -> AsyncIterator[KVEventSubscriber]:
    sub = KVEventSubscriber(index, endpoint, topic, replay, **options)
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
    async def main() -> None:
        index = EventIndex(BS)
        async with subscriber(index, ANY, "kv-a", None) as sub:
            config = EngineConfig(
                speed=0.001,
                kv_blocks=64,
                kv_events_endpoint=sub.endpoint,
                kv_events_topic="kv-a",
                kv_events_replay_endpoint=ANY,
            )
            app = create_app(config)
            publisher = app[KV_EVENTS]

            async def synced(body: dict[str, Any], path: str) -> dict[str, Any]:
                reply = await post(client, path, body)
                await settle(lambda: sub.tracker.last == publisher.seq - 1)
                return reply

            async def warm_up(attempt: int) -> None:
                await post(client, "/v1/completions", {"prompt": f"hello {attempt} " * 8})

            async with TestClient(TestServer(app)) as client:
                sub.replay_endpoint = publisher.replay_endpoint  # bound as the app started
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
                sub.replay_endpoint = publisher.replay_endpoint
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


@contextlib.asynccontextmanager
async def publishing(config: EngineConfig) -> AsyncIterator[KVEventPublisher]:
    """The mock engine's publisher alone, its sockets open (its replay answering)."""
    publisher = KVEventPublisher(config)
    async with contextlib.asynccontextmanager(publisher.serve)(web.Application()):
        yield publisher


@contextlib.asynccontextmanager
async def publishing_to(
    index: EventIndex, **options: Any
) -> AsyncIterator[tuple[KVEventPublisher, KVEventSubscriber]]:
    """A subscriber on topic "kv" that binds, and the mock engine's publisher connected to
    it as vLLM's connects to a router; the subscriber asks the replay socket the publisher
    bound once it did."""
    async with subscriber(index, ANY, "kv", None, **options) as sub:
        config = EngineConfig(kv_events_endpoint=sub.endpoint, kv_events_replay_endpoint=ANY)
        async with publishing(config) as publisher:
            sub.replay_endpoint = publisher.replay_endpoint
            yield publisher, sub


def replay_only() -> EngineConfig:
    """A publisher nobody subscribes to: all it sends is dropped, only its replay answers."""
    return EngineConfig(kv_events_endpoint=ANY, kv_events_bind=True, kv_events_replay_endpoint=ANY)


def test_a_gap_is_filled_from_replay_in_order() -> None:
    config = replay_only()
    tokens, batches = _batches()
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        async with publishing(config) as publisher:
            for events in batches:
                publisher.publish(events)
            index = EventIndex(BS)
            replay = publisher.replay_endpoint
            async with subscriber(index, ANY, "kv", replay) as sub:
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
                async with subscriber(late, ANY, "kv", replay) as s:
                    await s.receive(_frames(2, batches[2]))
                    assert late.match(keys) == 3
                    assert s.exact and s.counters.replayed == 2

    asyncio.run(main())


def test_an_empty_topic_takes_whatever_topic_the_engine_publishes_on() -> None:
    """vLLM's default topic is empty; a router left at it must not drop an engine's
    events because that engine names a topic."""
    tokens, batches = _batches()
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        index = EventIndex(BS)
        async with subscriber(index, ANY, "", None) as sub:
            config = EngineConfig(
                kv_events_endpoint=sub.endpoint,
                kv_events_topic="kv-a",
                kv_events_replay_endpoint=ANY,
            )
            async with publishing(config) as publisher:
                sub.replay_endpoint = publisher.replay_endpoint

                async def send(_attempt: int) -> None:
                    publisher.publish(batches[0])

                await until_heard(send, lambda: sub.counters.batches > 0)
                for events in batches[1:]:
                    publisher.publish(events)
                await settle(lambda: index.match(keys) == 3)
                assert sub.exact

    asyncio.run(main())


def test_an_unfilled_gap_or_bad_payload_makes_the_view_inexact_until_a_restart(caplog) -> None:
    tokens, batches = _batches()
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        index = EventIndex(BS)
        async with subscriber(index, ANY, "kv", None) as sub:
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


def exported(sub: KVEventSubscriber, kind: str) -> float:
    """A stream total as ``/metrics`` shows it."""
    registry = CollectorRegistry()
    registry.register(SubscriberCollector({"e": sub}))
    line = f'smetric_kv_events_total{{engine="e",kind="{kind}"}} '
    text = generate_latest(registry).decode()
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


def test_an_orphaned_block_degrades_the_view_until_a_resync_rebuilds_it(tmp_path) -> None:
    """A view that lost events (here: joined when the replay could not answer) learns it
    from the first orphan, says so in /metrics, and is rebuilt from the engine's replay
    buffer as soon as that answers."""
    # The replay's address must be known before anything binds it: a socket file, which no
    # other process can take.
    replay = f"ipc://{tmp_path}/replay"
    config = dataclasses.replace(replay_only(), kv_events_replay_endpoint=replay)
    tokens, batches = _batches()
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        index = EventIndex(BS)
        options = {"replay_timeout_s": 0.2, "resync_backoff_s": 0.0}
        async with subscriber(index, ANY, "kv", replay, **options) as sub:
            await sub.receive(_frames(1, batches[1]))  # the replay socket is not up yet
            assert not sub.exact and index.size() == 0
            assert exported(sub, "orphaned") == 1
            async with publishing(config) as publisher:
                for events in batches:
                    publisher.publish(events)
                await sub.receive(_frames(2, batches[2]))
                assert sub.exact and index.match(keys) == 3
                assert exported(sub, "resyncs") == 1
                assert exported(sub, "orphaned") == 2

    asyncio.run(main())


def test_a_restart_is_cleared_once_whether_the_stream_or_a_scrape_shows_it_first() -> None:
    tokens, batches = _batches()
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        index = EventIndex(BS)
        async with subscriber(index, ANY, "kv", None) as sub:
            before = time.monotonic()
            for seq in (5, 6):  # an old process's last batches
                await sub.receive(_frames(seq, batches[seq - 5]))
            await sub.receive(_frames(0, batches[0]))  # the new process, first in the stream
            await sub.engine_restarted(since=before)  # ...then in a scrape: nothing to drop
            assert index.match(keys) == 1 and sub.exact and sub.counters.restarts == 1

            # The scrape first: the view goes, and the next batch asks the replay from 0.
            await sub.engine_restarted(since=time.monotonic())
            assert index.size() == 0 and sub.counters.restarts == 2
            assert sub.tracker.last is None

    asyncio.run(main())


def test_a_token_id_out_of_range_is_left_out_and_the_stream_goes_on() -> None:
    """Once a ValueError in chain_hashes that killed the subscriber for good (and was
    raised again at shutdown); now the event is counted and the rest still applied."""
    tokens = list(range(2 * BS))
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        index = EventIndex(BS)
        async with publishing_to(index) as (publisher, sub):

            async def warm_up(attempt: int) -> None:
                publisher.publish([])

            await until_heard(warm_up, lambda: sub.counters.batches > 0)
            assert sub.exact
            bad = block_stored([9], None, [1 << 32] * BS, BS)
            publisher.publish([bad, block_stored([1], None, tokens[:BS], BS)])
            publisher.publish([block_stored([2], 1, tokens[BS:], BS)])
            await settle(lambda: index.match(keys) == 2)
            assert sub.counters.invalid_events >= 1 and not sub.exact
        # Closing raised the subscriber's error again before; now it returns.

    asyncio.run(main())


class FailingOnce(EventIndex):
    """An index whose first ``apply`` fails as an unforeseen bug would."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.failed = False

    def apply(self, events: Any) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("an unforeseen bug")
        super().apply(events)


def test_a_failing_subscriber_is_restarted_and_its_view_resynced(caplog) -> None:
    tokens = list(range(BS))

    async def main() -> None:
        index = FailingOnce(BS)
        async with publishing_to(index, resync_backoff_s=0.0) as (publisher, sub):

            async def warm_up(attempt: int) -> None:
                publisher.publish([{"type": "AllBlocksCleared"}])

            await until_heard(warm_up, lambda: sub.counters.failures > 0)
            assert not sub.exact and exported(sub, "failures") == 1
            publisher.publish([block_stored([1], None, tokens, BS)])
            await settle(lambda: index.match(chain_hashes(tokens, BS)) == 1 and sub.exact)
            assert sub.counters.resyncs == 1 and sub.counters.failures == 1

    with caplog.at_level("WARNING", logger="smetric.serve"):
        asyncio.run(main())
    events = [json.loads(r.getMessage())["event"] for r in caplog.records]
    assert events[:3] == ["kv_subscriber_failed", "kv_view_degraded", "kv_view_resynced"]


def test_an_engine_ejected_and_readmitted_keeps_its_events_view() -> None:
    """A transient ejection (the engine kept its cache) once cleared the view, so the next
    turn's hit was predicted 0 and its BlockStored dropped as orphaned."""
    # The engine binds (the router needs its URL first, so the engine starts first).
    config = EngineConfig(
        speed=0.001, kv_events_endpoint=ANY, kv_events_bind=True, kv_events_replay_endpoint=ANY
    )

    async def main() -> None:
        app = create_app(config)
        publisher = app[KV_EVENTS]
        async with TestClient(TestServer(app)) as engine_client:
            url = str(engine_client.make_url("")).rstrip("/")
            engine = Engine(url, config.kv_blocks, events=EventIndex(BS))
            sub = KVEventSubscriber(
                view_of(engine),
                publisher.endpoint,
                "kv",
                publisher.replay_endpoint,
                bind=False,
                name=url,
            )
            router = Router(
                [engine], RouterSettings(health_interval_s=0.05), subscribers={url: sub}
            )
            async with TestClient(TestServer(router.app())) as client:

                async def warm_up(attempt: int) -> None:
                    await post(engine_client, "/v1/completions", {"prompt": f"hi {attempt} " * 8})

                await until_heard(warm_up, lambda: sub.counters.batches > 0)
                first = [SYSTEM, {"role": "user", "content": "List the files in src/."}]
                one = await post(client, "/v1/chat/completions", {"messages": first})
                await settle(lambda: sub.tracker.last == publisher.seq - 1)
                held = view_of(engine).size()
                assert held > 0

                router.pool.eject(engine, "a transient error")
                await settle(lambda: engine.healthy)  # the next health check re-admits it
                assert view_of(engine).size() == held and sub.exact

                answer = {"role": "assistant", "content": one["choices"][0]["message"]["content"]}
                body = {"messages": [*first, answer, {"role": "user", "content": "Go on."}]}
                response = await client.post("/v1/chat/completions", json=body)
                predicted = int(response.headers["x-smetric-predicted-hit-tokens"])
                assert cached(await response.json()) == predicted > 0
                await settle(lambda: sub.tracker.last == publisher.seq - 1)
                assert sub.counters.orphaned == 0 and sub.exact

    asyncio.run(main())


def test_two_routers_on_one_engine_process_that_binds_its_publisher(tmp_path) -> None:
    """The documented recipe for several routers on one engine (docs/guides/serve-vllm.md),
    with the real CLI: the engine binds ``tcp://*:PORT`` as vLLM does, both routers connect
    (``bind: false``), and a turn served through one router is predicted by the other from
    events alone."""
    events = ("--kv-events-endpoint", "tcp://*:*", "--kv-events-replay-endpoint", ANY)
    process = SmetricProcess(tmp_path, args=("engine", "--speed", "0.001", *events))
    config = tmp_path / "engines.yaml"

    async def main() -> None:
        async with aiohttp.ClientSession() as direct:
            routers = []
            for _ in range(2):
                listed = load_config(ServeConfig, config).engines
                engines, subscribers = engines_from(listed, 1000, BS)
                settings = RouterSettings(health_interval_s=60)
                routers.append(Router(engines, settings, subscribers=subscribers))
            clients = [TestClient(TestServer(r.app())) for r in routers]
            for client in clients:
                await client.start_server()
            try:
                subs = [next(iter(r.subscribers.values())) for r in routers]

                async def warm_up(attempt: int) -> None:
                    body = {"prompt": f"warm-up {attempt} " * 8, "max_tokens": 1}
                    async with direct.post(url + "/v1/completions", json=body) as response:
                        assert response.status == 200

                await until_heard(warm_up, lambda: all(s.counters.batches for s in subs))
                first = [SYSTEM, {"role": "user", "content": "Read README.md."}]
                one = await post(clients[0], "/v1/chat/completions", {"messages": first})
                reply = {"role": "assistant", "content": one["choices"][0]["message"]["content"]}
                body = {"messages": [*first, reply, {"role": "user", "content": "Next."}]}
                facts = analyze_request(body, "chat", _TOKENIZER, BS)
                engine = routers[1].engines[0]
                await settle(
                    lambda: engine.predicted_hit(facts.blocks, BS, facts.prompt_tokens) > 0
                )
                response = await clients[1].post("/v1/chat/completions", json=body)
                predicted = int(response.headers["x-smetric-predicted-hit-tokens"])
                assert cached(await response.json()) == predicted > 0
                assert all(s.exact for s in subs)
            finally:
                for client in clients:
                    await client.close()

    try:
        process.start()
        process.wait_ready(60.0)
        ports = startup_events_ports(process.log_since_start())
        assert ports is not None, process.log_tail()
        url = process.url
        config.write_text("engines:\n" + events_engine(process.port, *ports, "kv", bind="false"))
        asyncio.run(main())
    finally:
        process.stop()


def test_a_view_the_replay_cannot_rebuild_waits_for_a_restart(caplog) -> None:
    """Joining after the engine's buffer moved past batch 0, the view cannot be rebuilt:
    one try says so, and no more replays are asked for until the engine restarts."""
    config = dataclasses.replace(replay_only(), kv_events_buffer_steps=2)
    _, batches = _batches()

    async def main() -> None:
        async with publishing(config) as publisher:
            for events in batches:
                publisher.publish(events)  # the buffer keeps batches 1 and 2
            index = EventIndex(BS)
            replay = publisher.replay_endpoint
            async with subscriber(index, ANY, "kv", replay) as sub:
                await sub.receive(_frames(2, batches[2]))
                assert not sub.exact and sub.counters.resyncs == 0
                replayed = sub.counters.replayed
                await sub.receive(_frames(3, []))
                assert sub.counters.replayed == replayed  # no futile replay asked for
                await sub.receive(_frames(0, batches[0]))  # the engine restarted
                assert sub.exact and index.size() == 1

    with caplog.at_level("WARNING", logger="smetric.serve"):
        asyncio.run(main())
    events = [json.loads(r.getMessage())["event"] for r in caplog.records]
    assert events == ["kv_view_degraded", "kv_view_unresyncable", "kv_events_restart"]


def test_a_scraped_restart_clears_the_events_view_only_if_the_stream_did_not_show_it(
    tmp_path,
) -> None:
    # Every engine process connects to the router's subscriber, which binds a socket file
    # (its address known before the router, which needs the engine's URL, exists); the
    # first process binds the ports the OS picks, and each restart the same ones again.
    config = EngineConfig(
        speed=0.001,
        kv_events_endpoint=f"ipc://{tmp_path}/events",
        kv_events_bind=False,
        kv_events_replay_endpoint=ANY,
    )

    async def engine_process(config: EngineConfig, port: int = 0) -> TestClient:
        client = TestClient(TestServer(create_app(config), host="127.0.0.1", port=port))
        await client.start_server()
        return client

    def warm_up(process: TestClient) -> Callable[[int], Awaitable[None]]:
        async def send(attempt: int) -> None:
            body = {"prompt": f"hi {attempt} " * 8, "max_tokens": 1}
            await post(process, "/v1/completions", body)

        return send

    async def main() -> None:
        first: TestClient | None = await engine_process(config)
        assert first is not None and first.port is not None
        port, publisher = first.port, first.app[KV_EVENTS]
        replay = publisher.replay_endpoint
        same = dataclasses.replace(config, kv_events_replay_endpoint=replay)
        url = f"http://127.0.0.1:{port}"
        engine = Engine(url, config.kv_blocks, events=EventIndex(BS))
        endpoint = publisher.endpoint
        sub = KVEventSubscriber(view_of(engine), endpoint, "kv", replay, bind=True, name=url)
        router = Router([engine], RouterSettings(health_interval_s=60), subscribers={url: sub})
        async with TestClient(TestServer(router.app())) as client:
            for restart_in_stream_first in (False, True):
                process = first or await engine_process(same, port)
                first = None
                await router.pool.check(engine)  # up after the router's first health check
                heard = sub.counters.batches
                await until_heard(warm_up(process), past(lambda: sub.counters.batches, heard))
                await router.pool.scrape(engine)
                await post(client, "/v1/completions", {"prompt": "p" * 200, "max_tokens": 1})
                await settle(lambda: view_of(engine).size() >= 200 // BS)
                await process.close()
                process = await engine_process(same, port)  # a new process, same addresses
                restarts = sub.counters.restarts
                if restart_in_stream_first:
                    await until_heard(
                        warm_up(process), past(lambda: sub.counters.restarts, restarts)
                    )
                    # The restart is counted before the batch that showed it is applied
                    # (batches apply in slices, the event loop between them).
                    await settle(lambda: view_of(engine).size() > 0)
                held = view_of(engine).size()
                await router.pool.scrape(engine)
                assert sub.counters.restarts == restarts + 1  # counted once either way
                if restart_in_stream_first:
                    assert view_of(engine).size() == held > 0  # the new process's blocks stay
                else:
                    assert view_of(engine).size() == 0  # the old process's blocks go
                await process.close()

    asyncio.run(main())


def test_blocks_of_another_size_degrade_the_view_and_are_exported() -> None:
    """An engine hashing 32-token blocks for a router hashing 16: nothing it stores can be
    keyed, so a view that stayed "exact" while empty now says it is not."""

    async def main() -> None:
        index = EventIndex(BS)
        async with subscriber(index, ANY, "kv", None) as sub:
            await sub.receive(_frames(0, [block_stored([1], None, list(range(2 * BS)), 2 * BS)]))
            assert not sub.exact and index.size() == 0
            assert exported(sub, "mismatched") == 1

    asyncio.run(main())


def _chain(count: int, size: int = 16) -> list[list[dict[str, Any]]]:
    """``count`` batches storing ``size`` blocks each, every block the child of the one
    before, so that a view missing any batch orphans every later one."""
    tokens = [t % 251 for t in range(size * BS)]
    return [
        [block_stored(list(range(i * size + 1, (i + 1) * size + 1)), i * size or None, tokens, BS)]
        for i in range(count)
    ]


def test_a_long_replay_history_is_applied_whole_within_a_per_message_deadline() -> None:
    """6,000 batches in the engine's replay buffer (vLLM keeps up to 10,000): the replay
    that fills a lost batch's hole, and the resync of a view that lost an event, take far
    longer in all than the replay deadline, which bounds each message, not the whole
    answer; the view is exact again within seconds."""
    config = dataclasses.replace(replay_only(), kv_events_buffer_steps=10_000)
    batches = _chain(6_002)

    async def main() -> None:
        async with publishing(config) as publisher:
            for events in batches[:6_000]:
                publisher.publish(events)
            index = EventIndex(BS)
            replay = publisher.replay_endpoint
            options = {"replay_timeout_s": 0.5, "resync_backoff_s": 0.0}
            async with subscriber(index, ANY, "kv", replay, **options) as sub:
                began = time.monotonic()
                await sub.receive(_frames(5_999, batches[5_999]))  # batches 0..5998 lost
                assert sub.exact and index.size() == 6_000 * 16, sub.counters
                assert sub.counters.replayed == 5_999 and sub.counters.unrecovered == 0
                # A batch that cannot be read is lost for good: the resync replays all
                # 6,001 batches into a fresh view.
                publisher.publish(batches[6_000])
                await sub.receive([b"kv", (6_000).to_bytes(8, "big"), b"\xc1"])
                assert sub.exact and sub.counters.resyncs == 1, sub.counters
                assert index.size() == 6_001 * 16
                publisher.publish(batches[6_001])
                await sub.receive(_frames(6_001, batches[6_001]))
                assert sub.exact and index.size() == 6_002 * 16
                assert time.monotonic() - began < 15

    asyncio.run(main())


# Another process, as an engine is: a publisher that waits for the router's subscription
# (XPUB hears it), then sends one event of BIG blocks and SMALL batches of 32 blocks, all
# stored and never removed, as fast as it can, queueing what the network cannot take yet.
_FLOOD = """
import sys, msgspec, zmq
endpoint, big, small = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
context = zmq.Context()
pub = context.socket(zmq.XPUB)
pub.setsockopt(zmq.SNDHWM, 0)
pub.connect(endpoint)
pub.recv()
def stored(hashes):
    tokens = [t % 50_000 for t in range(16 * len(hashes))]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": 16}
def send(seq, events):
    payload = msgspec.msgpack.encode([0.0, events, 0])
    pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
send(0, [stored(list(range(10**9, 10**9 + big)))])
for seq in range(1, small + 1):
    send(seq, [stored([seq * 32 + i]) for i in range(32)])
context.destroy(linger=30_000)
"""


def test_an_event_flood_leaves_http_served_and_the_view_within_its_cap() -> None:
    """One event of 100,000 blocks, then 3,000 batches of 32, never removed, sent by
    another process as fast as it can to a router that binds its KV-event endpoint, while
    ``/health`` is asked again and again: each answer comes within 0.5 s (the events are
    applied in slices, the big one decoded beside the event loop), and the engine's view
    never holds more than its cap of 20,000 blocks, the oldest forgotten first."""
    cap, big, small = 20_000, 100_000, 3_000

    async def main() -> None:
        index = EventIndex(BS, max_blocks=cap)
        sub = KVEventSubscriber(index, ANY, "kv")
        engine = Engine(f"http://127.0.0.1:{closed_port()}", 1000, events=index)
        settings = RouterSettings(health_interval_s=60)
        router = Router([engine], settings, subscribers={engine.url: sub})
        async with TestClient(TestServer(router.app())) as client:
            args = (sub.endpoint, str(big), str(small))
            flood = subprocess.Popen([sys.executable, "-c", _FLOOD, *args])
            slowest = 0.0
            try:
                deadline = time.monotonic() + 60
                while sub.counters.batches < 1 + small:
                    assert time.monotonic() < deadline, sub.counters
                    # A client that asks now waits for the loop's turn as well: the
                    # time past the pause is what the loop kept to itself.
                    began = time.monotonic()
                    await asyncio.sleep(0.02)
                    response = await client.get("/health")
                    await response.read()
                    slowest = max(slowest, time.monotonic() - began - 0.02)
                    assert index.blocks <= cap
            finally:
                flood.kill()
                flood.wait()
            assert slowest < 0.5, f"/health took {slowest:.2f} s during the flood"
            assert index.blocks == cap and not sub.exact
            assert sub.counters.evicted == big + 32 * small - cap == exported(sub, "evicted")

    asyncio.run(main())


@pytest.mark.parametrize(
    ("endpoint", "exposed"),
    [("tcp://*:*", True), ("tcp://0.0.0.0:*", True), (ANY, False), ("ipc://@smetric-kv", False)],
)
def test_a_kv_event_endpoint_bound_beyond_loopback_is_warned_about(
    endpoint: str, exposed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Any host that reaches a bound endpoint can publish: ZMQ has no authentication. The
    router says so at start-up when it binds one beyond loopback."""

    async def main() -> None:
        async with subscriber(EventIndex(BS), endpoint, "kv", None, bind=True):
            pass

    with caplog.at_level("WARNING", logger="smetric.serve"):
        asyncio.run(main())
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    warned = [x for x in lines if x["event"] == "kv_events_endpoint_exposed"]
    assert len(warned) == exposed
    if exposed:
        assert "no authentication" in warned[0]["warning"]


def test_a_resync_rebuilds_the_view_within_its_cap() -> None:
    """A view of at most 2 blocks: rebuilt from a history of 2 after a lost batch, it is
    exact again; a third block takes it past its cap, and the rebuild from all 3 keeps
    the cap too, so it is not taken and the view stays inexact."""
    config = replay_only()
    tokens, batches = _batches()
    keys = chain_hashes(tokens, BS)

    async def main() -> None:
        async with publishing(config) as publisher:
            for events in batches:
                publisher.publish(events)
            index = EventIndex(BS, max_blocks=2)
            replay = publisher.replay_endpoint
            async with subscriber(index, ANY, "kv", replay, resync_backoff_s=0.0) as sub:
                await sub.receive(_frames(0, batches[0]))
                await sub.receive([b"kv", (1).to_bytes(8, "big"), b"\xc1"])  # lost
                assert sub.exact and sub.counters.resyncs == 1
                await sub.receive(_frames(2, batches[2]))
                assert index.blocks == 2 and index.match(keys) == 0  # block 1 forgotten
                assert not sub.exact and sub.counters.resyncs == 1

    asyncio.run(main())
