"""The router over real HTTP on loopback: bad input, auth, failover, and (with the mock
engine) routing that lands follow-ups where their prefix is cached."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(coro: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro())


async def with_router(
    router: Router, body: Callable[[aiohttp.ClientSession, str], Awaitable[Any]]
) -> Any:
    server = TestServer(router.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            return await body(client, f"http://127.0.0.1:{server.port}")
    finally:
        await server.close()


def dead_router(**settings: Any) -> Router:
    engines = [Engine(f"http://127.0.0.1:{closed_port()}", 1024)]
    return Router(engines, RouterSettings(health_interval_s=60, **settings))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_malformed_requests_get_openai_style_4xx() -> None:
    async def body(client: aiohttp.ClientSession, url: str) -> None:
        cases = [
            (b"{not json", 400),
            (b"[1, 2]", 400),
            (json.dumps({"model": "m"}).encode(), 400),  # no messages
            (json.dumps({"messages": "hi"}).encode(), 400),
            (json.dumps({"messages": [{"content": "x"}]}).encode(), 400),  # no role
            (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),  # bad UTF-8
            (b"x" * (2 << 20), 413),
        ]
        for payload, status in cases:
            async with client.post(url + "/v1/chat/completions", data=payload) as response:
                assert response.status == status, payload[:40]
                error = (await response.json())["error"]
                assert error["code"] == status and error["message"]

    run(lambda: with_router(dead_router(max_body_bytes=1 << 20), body))


def test_api_keys_are_enforced() -> None:
    async def body(client: aiohttp.ClientSession, url: str) -> None:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            assert response.status == 401
            assert (await response.json())["error"]["type"] == "authentication_error"
        headers = {"Authorization": "Bearer secret"}
        async with client.post(
            url + "/v1/chat/completions", json=CHAT, headers=headers
        ) as response:
            assert response.status == 503  # authorised; the only engine is down

    run(lambda: with_router(dead_router(api_keys=frozenset({"secret"})), body))


def test_unreachable_engine_is_ejected_and_health_says_so() -> None:
    router = dead_router()

    async def body(client: aiohttp.ClientSession, url: str) -> None:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            assert response.status == 503
        assert router.engines[0].healthy is False
        async with client.get(url + "/health") as response:
            assert response.status == 503
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        engine = router.engines[0].url
        assert f'smetric_engine_healthy{{engine="{engine}"}} 0.0' in text

    run(lambda: with_router(router, body))
