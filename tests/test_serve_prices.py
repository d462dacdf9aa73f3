"""The live router's price feed: what the learner learns reaches the policy and the
Prometheus gauge; a spec's values and ``learn=0`` are left alone."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry, Gauge

from smetric.core.policies import make_policy
from smetric.core.policies.prices import PriceLearner
from smetric.core.policies.smetric_cost import SMetricCost
from smetric.serve.prices import PriceFeed
from smetric.testing.prices import H20_PRICES, model_engines

pytestmark = pytest.mark.server

if TYPE_CHECKING:
    from smetric.serve.app import Router


def gauge() -> tuple[Gauge, CollectorRegistry]:
    registry = CollectorRegistry()
    return Gauge("smetric_learned_price", "x", ["constant"], registry=registry), registry


def test_the_feed_retunes_the_policy_and_exports_what_it_learned() -> None:
    spec = "smetric_cost:prefill_tps=28400,attn_tokens=22000,fetch_tps=50000"
    policy = make_policy(spec.replace("fetch_tps=50000", "fetch_tps=50000,learn=1"))
    assert isinstance(policy, SMetricCost)
    prices, registry = gauge()
    feed = PriceFeed(policy, spec, prices)
    assert registry.get_sample_value("smetric_learned_price", {"constant": "prefill_tps"}) == 28400
    for done in itertools.islice(model_engines(H20_PRICES, 0), 1_500):
        feed.observe(done)
    learned = registry.get_sample_value("smetric_learned_price", {"constant": "kv_read_s"})
    assert learned is not None
    assert abs(learned / H20_PRICES["kv_read_s"] - 1) < 0.1
    assert policy.kv_read_s == learned
    # Given in the spec: never learned, whatever the replies say.
    assert policy.prefill_tps == 28400
    assert policy.fetch_tps == 50000


def test_learn_0_feeds_nothing() -> None:
    policy = make_policy("smetric_cost:learn=0")
    assert isinstance(policy, SMetricCost)
    feed = PriceFeed(policy, "smetric_cost:learn=0", gauge()[0])
    assert feed.learning is None
    before = policy.prefill_tps
    for done in itertools.islice(model_engines(H20_PRICES, 0), 100):
        feed.observe(done)
    assert policy.prefill_tps == before


async def learn_behind_router(speed: float, requests: int) -> tuple[Router, str]:
    """A router with the default policy in front of two mock engines that run their model
    ``speed`` times slower than real time, after one session of ``requests`` streamed
    turns: the router and its /metrics text."""
    import asyncio

    import aiohttp
    from aiohttp.test_utils import TestServer

    from smetric.engine import EngineConfig, create_app
    from smetric.serve.app import Router, RouterSettings
    from smetric.serve.engines import Engine

    config = EngineConfig(speed=speed, kv_blocks=4096, default_max_tokens=8)
    servers = [TestServer(create_app(config), host="127.0.0.1") for _ in range(2)]
    for server in servers:
        await server.start_server()
    engines = [Engine(f"http://127.0.0.1:{s.port}", 4096) for s in servers]
    router = Router(engines, RouterSettings(health_interval_s=60))
    front = TestServer(router.app(), host="127.0.0.1")
    await front.start_server()
    url = f"http://127.0.0.1:{front.port}"
    try:
        async with asyncio.timeout(120), aiohttp.ClientSession() as client:
            messages = [{"role": "system", "content": "you are terse " * 200}]
            for turn in range(requests):
                messages.append({"role": "user", "content": f"question {turn} " * 100})
                chat = {
                    "model": "m",
                    "messages": messages,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                async with client.post(url + "/v1/chat/completions", json=chat) as reply:
                    assert reply.status == 200
                    assert "[DONE]" in await reply.text()
                messages.append({"role": "assistant", "content": f"answer {turn}"})
            async with client.get(url + "/metrics") as reply:
                metrics = await reply.text()
    finally:
        await front.close()
        for server in servers:
            await server.close()
    return router, metrics


def test_the_router_learns_from_real_streams_of_mock_engines() -> None:
    """Every streamed reply that reports its cached tokens is one observation of the
    router's learner; the policy takes what it learns, /metrics exports it, and engines
    ten times slower are learned to prefill and to decode slower (a stream's first chunk
    comes with its first token, after the prefill, as vLLM sends it)."""
    import asyncio

    requests = 20
    fast, metrics = asyncio.run(learn_behind_router(0.2, requests))
    slow, _ = asyncio.run(learn_behind_router(2.0, requests))
    policies = []
    for router in (fast, slow):
        learning = router.prices.learning
        assert learning is not None
        learner = learning.learner
        assert isinstance(learner, PriceLearner) and learner.observed == requests
        policy = router.core.policy
        assert isinstance(policy, SMetricCost)  # the default policy
        assert policy.prefill_tps == learner.estimates["prefill_tps"]
        assert policy.kv_read_s == learner.estimates["kv_read_s"]
        policies.append(policy)
    assert 'smetric_learned_price{constant="kv_read_s"}' in metrics
    kv_read = [policy.kv_read_s for policy in policies]
    assert kv_read[1] > 3 * kv_read[0]
    prefill_tps = [policy.prefill_tps for policy in policies]
    assert prefill_tps[0] > 3 * prefill_tps[1]


def test_a_stream_s_decode_runs_from_its_first_chunk_to_its_last() -> None:
    """What learning reads of a stream's decode: its chunks after the first, and the time
    from the first to the last; the engine's silence before it ends the stream is not
    decode."""
    import asyncio

    from aiohttp import web

    from smetric.serve.app import Router, RouterSettings
    from smetric.serve.engines import Engine
    from smetric.serve.forwarding import Completion

    from conftest import chat_engine, eventually, router_client

    chunk, gap_s, chunks, end_s = b'data: {"choices": []}\n\n', 0.05, 5, 0.5

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk)
        for _ in range(chunks):
            await asyncio.sleep(gap_s)
            await response.write(chunk)
        await asyncio.sleep(end_s)
        await response.write_eof()
        return response

    async def go() -> Completion:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        ended: list[Completion] = []
        async with chat_engine(stream) as port:
            router = Router([Engine(f"http://127.0.0.1:{port}", 1000)], RouterSettings())
            router.observers.append(ended.append)
            async with router_client(router.app(), True, 30) as (client, url):
                async with client.post(url + "/v1/chat/completions", json=chat) as reply:
                    assert reply.status == 200
                    assert (await reply.read()).count(chunk) == chunks + 1
                await eventually(lambda: ended)
        return ended[0]

    completion = asyncio.run(go())
    assert completion.decode_chunks == chunks
    assert chunks * gap_s * 0.9 <= completion.decode_s < chunks * gap_s + end_s / 2
