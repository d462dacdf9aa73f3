"""The Responses API through ``smetric serve``, driven by the OpenAI Python SDK: two router
replicas sharing nothing in front of two mock engines."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer
from openai.types.responses import Response, ResponseCompletedEvent

from smetric.engine.scheduler import EngineConfig
from smetric.engine.server import RESPONSES, create_app
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.testing.engines import metric

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

FAST = EngineConfig(speed=0.0001, kv_blocks=4096, default_max_tokens=8)
INSTRUCTIONS = "You are a coding agent. " * 20

Clients = list[openai.AsyncOpenAI]


async def with_replicas(body: Callable[[Clients, list[Router]], Awaitable[Any]]) -> None:
    """Two mock engines behind two routers, and an SDK client for each router."""
    engines = [TestServer(create_app(FAST), host="127.0.0.1") for _ in range(2)]
    for server in engines:
        await server.start_server()
    urls = [f"http://127.0.0.1:{s.port}" for s in engines]
    routers = [
        Router([Engine(u, 1000) for u in urls], RouterSettings(health_interval_s=0.05))
        for _ in range(2)
    ]
    fronts = [TestServer(r.app(), host="127.0.0.1") for r in routers]
    for front in fronts:
        await front.start_server()
    clients = [
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{f.port}/v1", api_key="k", max_retries=0)
        for f in fronts
    ]
    try:
        async with asyncio.timeout(10):
            while not all(e.healthy for r in routers for e in r.engines):
                await asyncio.sleep(0.02)
        await body(clients, routers)
    finally:
        for client in clients:
            await client.close()
        for server in [*fronts, *engines]:
            await server.close()


async def parsed(raw: Any) -> Response:
    """The response in a raw reply, streamed or not; a stream's events numbered in order
    from ``response.created`` to ``response.completed``."""
    reply = raw.parse()
    if isinstance(reply, Response):
        return reply
    events = [event async for event in reply]
    assert events[0].type == "response.created"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert isinstance(events[-1], ResponseCompletedEvent)
    return events[-1].response


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_codex_style_follow_ups_resend_history_and_hit_where_predicted() -> None:
    """``store: false``, the whole conversation in every request (as Codex sends it),
    streamed and not: each follow-up lands where its history is, and the router predicted
    exactly what the engine reports cached."""

    async def body(clients: Clients, routers: list[Router]) -> None:
        items: list[Any] = [user("fix the bug in parser.py " * 10)]
        homes = set()
        for turn in range(4):
            raw = await clients[0].responses.with_raw_response.create(
                model="m", instructions=INSTRUCTIONS, input=items, store=False, stream=turn % 2 == 1
            )
            response = await parsed(raw)
            assert response.status == "completed" and response.output_text
            homes.add(raw.headers["x-smetric-engine"])
            predicted = int(raw.headers["x-smetric-predicted-hit-tokens"])
            assert response.usage is not None
            cached = response.usage.input_tokens_details.cached_tokens
            assert predicted == cached
            assert (cached > 0) == (turn > 0)
            items += [item.model_dump(exclude_none=True) for item in response.output]
            items.append(user(f"and now step {turn}"))
        assert len(homes) == 1

    asyncio.run(with_replicas(body))


def test_a_stored_response_is_found_from_any_replica() -> None:
    async def body(clients: Clients, routers: list[Router]) -> None:
        first, other = clients
        first_raw = await first.responses.with_raw_response.create(
            model="m", instructions=INSTRUCTIONS, input="list the files " * 20
        )
        response = await parsed(first_raw)
        home = first_raw.headers["x-smetric-engine"]
        # The second replica never saw it, and its policy would spread a first turn.
        for stream in (False, True):
            raw = await other.responses.with_raw_response.create(
                model="m",
                instructions=INSTRUCTIONS,
                input="go on",
                previous_response_id=response.id,
                stream=stream,
            )
            assert raw.headers["x-smetric-engine"] == home
            follow_up = await parsed(raw)
            assert follow_up.previous_response_id == response.id
            assert follow_up.usage is not None
            # The stored conversation is the prompt's prefix, cached where it is stored.
            assert follow_up.usage.input_tokens_details.cached_tokens > 0
            response = follow_up
        text = routers[1].metrics.exposition(routers[1].engines).decode()
        assert metric(text, "smetric_routing_decisions_total", branch="stored_response") == 2

        assert (await other.responses.retrieve(response.id)).id == response.id
        await other.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError) as missing:
            await first.responses.retrieve(response.id)
        assert missing.value.body == {
            "message": f"Response with id '{response.id}' not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        with pytest.raises(openai.NotFoundError) as unknown:
            await first.responses.create(model="m", input="hi", previous_response_id="resp_x")
        assert isinstance(unknown.value.body, dict)
        assert unknown.value.body["param"] == "previous_response_id"

    asyncio.run(with_replicas(body))


def test_the_engine_bounds_output_and_its_store() -> None:
    """``max_output_tokens`` ends a response ``incomplete`` at that length; the store
    keeps the newest responses up to its bound."""

    async def body() -> None:
        server = TestServer(create_app(FAST), host="127.0.0.1")
        await server.start_server()
        server.app[RESPONSES].limit = 2
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k")
        try:
            bounded = await client.responses.create(model="m", input="hi", max_output_tokens=3)
            assert bounded.status == "incomplete"
            assert bounded.incomplete_details is not None
            assert bounded.incomplete_details.reason == "max_output_tokens"
            assert bounded.usage is not None and bounded.usage.output_tokens == 3
            natural = await client.responses.create(model="m", input="hi")
            assert natural.status == "completed"
            assert (
                natural.usage is not None and natural.usage.output_tokens == FAST.default_max_tokens
            )
            await client.responses.create(model="m", input="hi", store=False)
            newest = await client.responses.create(model="m", input="hi")
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(bounded.id)  # the oldest, out
            for kept in (natural, newest):
                assert (await client.responses.retrieve(kept.id)).output_text == kept.output_text
        finally:
            await client.close()
            await server.close()

    asyncio.run(body())
