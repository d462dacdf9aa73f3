"""The router builds the view the simulator builds: Dynamo's unprefilled tokens per engine,
session hashing over every configured engine, and one cap on a predicted hit."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import analyze_request
from smetric.core.policies import make_policy
from smetric.engine import EngineConfig, create_app
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.sim.cluster import Simulation
from smetric.sim.config import ClusterConfig, WorkloadConfig
from smetric.sim.instance import SimRequest
from smetric.sim.workload import build_workload

from conftest import closed_port, eventually, make_trace

pytestmark = pytest.mark.server

BS = 16


class HeldEngine:
    """An OpenAI-compatible engine on loopback that holds a request whose last message
    says HOLD: headers at once, then nothing until ``first_token`` is set (the prefill),
    then the rest once ``finish`` is set; any other request is answered at once."""

    def __init__(self) -> None:
        self.first_token = asyncio.Event()
        self.finish = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_get("/health", self._health)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        reply = {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
        }
        if "HOLD" not in body["messages"][-1]["content"]:
            return web.json_response(reply)
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        await self.first_token.wait()
        await response.write(b'data: {"choices": [{"delta": {"content": "d"}}]}\n\n')
        await self.finish.wait()
        await response.write(b"data: [DONE]\n\n")
        return response


def conversation(turns: int, last: str = "") -> list[dict[str, str]]:
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 20},
        {"role": "user", "content": "fix the bug " * 30},
    ]
    for turn in range(turns):
        messages += [
            {"role": "assistant", "content": f"step {turn} " * 10},
            {"role": "user", "content": f"output {turn} " * 10},
        ]
    if last:
        messages[-1] = {"role": "user", "content": last}
    return messages


async def with_held_engines(
    n: int, policy: str, body: Callable[..., Awaitable[Any]], **settings: Any
) -> Any:
    held = [HeldEngine() for _ in range(n)]
    servers = [TestServer(h.app, host="127.0.0.1") for h in held]
    for server in servers:
        await server.start_server()
    router = Router(
        [Engine(f"http://127.0.0.1:{s.port}", 1000) for s in servers],
        RouterSettings(policy=policy, health_interval_s=60, **settings),
    )
    front = TestServer(router.app(), host="127.0.0.1", handler_cancellation=True)
    await front.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            return await body(client, f"http://127.0.0.1:{front.port}", router, held)
    finally:
        for h in held:  # let held handlers end so the servers close at once
            h.first_token.set()
            h.finish.set()
        await front.close()
        for server in servers:
            await server.close()


async def chat(client: aiohttp.ClientSession, url: str, messages: list[dict]) -> str:
    payload = {"model": "m", "messages": messages, "max_tokens": 4}
    async with client.post(url + "/v1/chat/completions", json=payload) as response:
        assert response.status == 200, await response.text()
        return response.headers["x-smetric-engine"]


def prompt_tokens(messages: list[dict]) -> int:
    return analyze_request({"messages": messages}, "chat", ByteTokenizer(), BS).prompt_tokens


def test_prefill_tokens_counts_unprefilled_tokens_until_the_first_token() -> None:
    """An engine prefilling a long prompt holds more unprefilled tokens than a follow-up's
    cached prefix saves, so Dynamo's rule sends the follow-up to the idle engine; counted
    in requests (the old view) the busy engine would win by its hit."""

    async def body(client, url, router: Router, held: list[HeldEngine]) -> None:
        home = await chat(client, url, conversation(0))
        busy, idle = router.engines if home == router.engines[0].url else router.engines[::-1]
        holder = held[router.engines.index(busy)]
        # A long request extending the session's prefix lands on its home and is held
        # in prefill there (the router answers the client at the first chunk).
        long = conversation(1, "HOLD " + "new context " * 400)
        facts = analyze_request({"messages": long}, "chat", ByteTokenizer(), BS)
        predicted = busy.predicted_hit(facts.blocks, BS, facts.prompt_tokens)
        assert predicted > 0
        queued = prompt_tokens(long) - predicted
        payload = {"model": "m", "messages": long, "stream": True}
        sent = asyncio.create_task(client.post(url + "/v1/chat/completions", json=payload))
        await eventually(lambda: busy.inflight == 1)
        assert (busy.unprefilled, busy.inflight, idle.unprefilled) == (queued, 1, 0)
        async with client.get(url + "/metrics") as metrics:
            text = await metrics.text()
        assert f'smetric_engine_unprefilled_tokens{{engine="{busy.url}"}} {float(queued)}' in text

        follow_up = conversation(1)
        facts = analyze_request({"messages": follow_up}, "chat", ByteTokenizer(), BS)
        # Counted in requests, the busy engine's score (1 + prompt - hit) would beat the
        # idle one's (0 + prompt): its hit is worth more than one request.
        assert busy.predicted_hit(facts.blocks, BS, facts.prompt_tokens) > busy.inflight
        assert await chat(client, url, follow_up) == idle.url

        holder.first_token.set()  # the first token: prefilled, still in flight
        response = await sent
        assert response.headers["x-smetric-engine"] == busy.url
        assert int(response.headers["x-smetric-predicted-hit-tokens"]) == predicted
        assert (await response.content.readline()).startswith(b"data: ")
        await eventually(lambda: busy.unprefilled == 0)
        assert busy.inflight == 1
        holder.finish.set()
        await response.read()
        response.close()
        await eventually(lambda: busy.inflight == 0)

    asyncio.run(with_held_engines(2, "prefill_tokens", body))


def test_unprefilled_tokens_come_back_when_the_client_leaves_before_the_first_token() -> None:
    async def body(client, url, router: Router, held: list[HeldEngine]) -> None:
        payload = {"model": "m", "messages": conversation(0, "HOLD " + "x " * 300)}
        sent = asyncio.create_task(client.post(url + "/v1/chat/completions", json=payload))
        engine = router.engines[0]
        await eventually(lambda: engine.unprefilled > 0)
        sent.cancel()  # gone before the first token
        await eventually(lambda: engine.unprefilled == 0)

    asyncio.run(with_held_engines(1, "least_load", body))


def test_unprefilled_tokens_come_back_when_the_connection_fails() -> None:
    async def body(client, url, router: Router, held: list[HeldEngine]) -> None:
        assert await chat(client, url, conversation(0)) == router.engines[1].url
        assert [e.unprefilled for e in router.engines] == [0, 0]

    async def scenario() -> None:
        server = TestServer(HeldEngine().app, host="127.0.0.1")
        await server.start_server()
        router = Router(
            [
                Engine(f"http://127.0.0.1:{closed_port()}", 1000),
                Engine(str(server.make_url("")), 1000),
            ],
            RouterSettings(policy="round_robin", health_interval_s=60),
        )
        front = TestServer(router.app(), host="127.0.0.1")
        await front.start_server()
        try:
            async with aiohttp.ClientSession() as client:
                await body(client, f"http://127.0.0.1:{front.port}", router, [])
        finally:
            await front.close()
            await server.close()

    asyncio.run(scenario())


def test_session_hash_moves_only_the_ejected_engine_s_sessions() -> None:
    router = Router(
        [Engine(f"http://127.0.0.1:{closed_port()}", 1000) for _ in range(4)],
        RouterSettings(policy="session_hash"),
    )
    sessions = [
        analyze_request(
            {"messages": [{"role": "user", "content": f"session {s}"}]}, "chat", ByteTokenizer(), BS
        )
        for s in range(400)
    ]
    before = [router.core.decide(facts, router.engines).engine for facts in sessions]
    ejected = router.engines[2]
    healthy = [e for e in router.engines if e is not ejected]
    after = [router.core.decide(facts, healthy).engine for facts in sessions]
    moved = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a is not b]
    assert len({e.url for e in before}) == 4
    assert moved == [i for i, b in enumerate(before) if b is ejected]
    assert 60 < len(moved) < 140  # about a quarter of 400


def test_router_and_simulator_cap_a_full_prompt_hit_alike() -> None:
    """A prompt whose every block is cached still computes its last block's tokens, in the
    router's prediction, the simulator's view and the simulator's queued prefill alike."""
    blocks = [11, 12, 13, 14]
    prompt = len(blocks) * BS  # exactly four blocks: nothing beyond the last one
    rows = [
        {
            "session_id": "s",
            "turn": 0,
            "block_ids": blocks,
            "input_tokens": prompt,
            "output_tokens": 2,
            "block_size": BS,
        }
    ]
    sim = Simulation(
        ClusterConfig(instances=1, kv_capacity_tokens=4096),
        make_policy("prefill_tokens"),
        build_workload(make_trace(rows), WorkloadConfig(session_rate=1.0, duration_s=1.0, seed=0)),
    )
    keys = np.array(blocks, dtype=np.int64)
    instance = sim.instances[0]
    instance.pool.cache.insert(keys, 0.0)
    request = SimRequest(0, "s", 1, keys, prompt, 2, prompt, BS)

    engine = Engine("http://127.0.0.1:1", 1000)
    engine.remember(keys)
    predicted = engine.predicted_hit(keys, BS, prompt)
    assert predicted == (len(blocks) - 1) * BS
    assert sim.view(request).hit_tokens == [predicted]
    instance.enqueue(request, 0.0)
    assert instance.unprefilled == prompt - predicted


def test_readmission_keeps_the_prefix_index_unless_the_engine_restarted() -> None:
    """With scrapes the router can tell a blip from a restart: a re-admitted engine whose
    start time did not change keeps its index; one that restarted loses it."""
    fast = EngineConfig(speed=0.0001, default_max_tokens=4)

    async def scenario() -> None:
        server = TestServer(create_app(fast), host="127.0.0.1")
        await server.start_server()
        engine = Engine(f"http://127.0.0.1:{server.port}", 1000)
        settings = RouterSettings(health_interval_s=0.05, scrape_interval_s=0.05)
        router = Router([engine], settings)
        front = TestServer(router.app(), host="127.0.0.1")
        await front.start_server()
        try:
            async with aiohttp.ClientSession() as client:
                url = f"http://127.0.0.1:{front.port}"
                await eventually(lambda: engine.report is not None)
                await chat(client, url, conversation(0))
                held = engine.view_blocks()
                assert held > 0
                router.pool.eject(engine, "a transient error")
                await eventually(lambda: engine.healthy)
                assert engine.view_blocks() == held  # the same process: nothing forgotten

                port = server.port
                await server.close()
                await eventually(lambda: not engine.healthy)
                server = TestServer(create_app(fast), host="127.0.0.1", port=port)
                await server.start_server()
                await eventually(lambda: engine.healthy)
                assert engine.view_blocks() == 0  # a new process: its cache is gone
        finally:
            await front.close()
            await server.close()

    asyncio.run(scenario())
