"""The router in front of a disaggregated mock cluster, over real HTTP on loopback: the
prefill leg, the decode leg pulling the prompt's KV, and each failure the router handles."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_serve import conversation, wait_healthy

from smetric.core.headers import DECODE_HEADER, PREFILL_HEADER
from smetric.engine.disagg import KV_TRANSFER_PARAMS, TRANSFERS
from smetric.engine.scheduler import EngineConfig
from smetric.engine.server import create_app
from smetric.serve.app import Router, RouterSettings
from smetric.serve.disagg import Disaggregation
from smetric.serve.engines import Engine
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.faulty import Fault, FaultyEngine

from conftest import closed_port, router_client

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

FAST = {"speed": 0.001, "kv_blocks": 2048}


def fake_engine(complete) -> web.Application:
    """An engine that answers health checks and completes chats with ``complete``."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/health", health)
    return app


def keyless_prefill_app() -> web.Application:
    """A prefill engine whose connector is keyed by the prompt (vLLM's ExampleConnector,
    LMCache): it answers the one token and no ``kv_transfer_params``."""

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["max_tokens"] == 1 and body[KV_TRANSFER_PARAMS]["do_remote_decode"]
        return web.json_response({"choices": [{"message": {"content": "x"}}]})

    return fake_engine(complete)


@dataclass
class Cluster:
    """The engines behind the router: mock engines by URL, misbehaving ones by URL."""

    servers: dict[str, TestServer] = field(default_factory=dict)
    fakes: dict[str, FaultyEngine] = field(default_factory=dict)

    async def start(self, app: web.Application) -> str:
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        url = f"http://127.0.0.1:{server.port}"
        self.servers[url] = server
        return url

    async def fake(self, fault: Fault) -> str:
        engine = await FaultyEngine(fault).start()
        self.fakes[engine.url] = engine
        return engine.url

    async def close(self) -> None:
        for server in self.servers.values():
            await server.close()
        for engine in self.fakes.values():
            await engine.close()


async def with_pd(
    body: Callable[[aiohttp.ClientSession, str, Router, Cluster], Awaitable[Any]],
    prefill: int = 2,
    decode: int = 2,
    dead_prefill: int = 0,
    dead_decode: int = 0,
    prefill_faults: tuple[Fault, ...] = (),
    decode_faults: tuple[Fault, ...] = (),
    decode_urls: tuple[str, ...] = (),
    prefill_apps: tuple[Callable[[], web.Application], ...] = (),
    prefill_config: dict[str, Any] | None = None,
    decode_config: dict[str, Any] | None = None,
    decode_policy: str = "least_kv",
    handler_cancellation: bool = True,
    **settings: Any,
) -> Any:
    """Mock prefill and decode engines behind a router with ``settings``, listed after
    dead ones, misbehaving ones, other prefill apps and decode engines started elsewhere
    (``decode_urls``); every request must end within 60 s."""
    cluster = Cluster()
    prefills = [f"http://127.0.0.1:{closed_port()}" for _ in range(dead_prefill)]
    prefills += [await cluster.fake(fault) for fault in prefill_faults]
    prefills += [await cluster.start(make()) for make in prefill_apps]
    for _ in range(prefill):
        config = {**FAST, **(prefill_config or {})}
        prefills.append(await cluster.start(create_app(EngineConfig(role="prefill", **config))))
    decodes = [f"http://127.0.0.1:{closed_port()}" for _ in range(dead_decode)]
    decodes += [await cluster.fake(fault) for fault in decode_faults]
    decodes += decode_urls
    for _ in range(decode):
        config = {**FAST, **(decode_config or {})}
        decodes.append(await cluster.start(create_app(EngineConfig(role="decode", **config))))
    router = Router(
        [Engine(u, 2048) for u in prefills + decodes],
        RouterSettings(**{"health_interval_s": 60, **settings}),
        disagg=Disaggregation(frozenset(prefills), frozenset(decodes), decode_policy),
    )
    try:
        async with router_client(router.app(), handler_cancellation, 60) as (client, url):
            return await body(client, url, router, cluster)
    finally:
        await cluster.close()


async def ask(
    client: aiohttp.ClientSession, url: str, messages: list[dict], status: int = 200, **extra: Any
) -> tuple[aiohttp.ClientResponse, Any]:
    payload = {"model": "m", "messages": messages, "max_tokens": 4, **extra}
    async with client.post(url + "/v1/chat/completions", json=payload) as response:
        data = await (response.text() if extra.get("stream") else response.json())
        assert response.status == status, data
        return response, data


def test_prefill_then_decode_with_the_prompt_pulled_and_counted_as_cached() -> None:
    async def body(client, url, router, cluster) -> None:
        messages = conversation(0, 0)
        response, data = await ask(client, url, messages)
        prefill, decode = response.headers[PREFILL_HEADER], response.headers[DECODE_HEADER]
        assert prefill in router.disagg.prefill_urls and decode in router.disagg.decode_urls
        assert data["usage"]["completion_tokens"] == 4  # the decode's, not the prefill's 1
        prompt = data["usage"]["prompt_tokens"]
        # Every full block but the one holding the last token came over from the prefill.
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16
        assert KV_TRANSFER_PARAMS not in data
        # The prefill engine held the blocks only until the decode engine pulled them.
        assert cluster.servers[prefill].app[TRANSFERS].held == {}
        # A follow-up goes to the prefill engine that holds its history.
        messages += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "and?"}]
        again, _ = await ask(client, url, messages)
        assert again.headers[PREFILL_HEADER] == prefill
        _, text = await ask(client, url, messages, stream=True)
        assert text.rstrip().endswith("data: [DONE]") and text.count('"content"') >= 4
        metrics = await (await client.get(url + "/metrics")).text()
        assert f'smetric_pd_routed_total{{engine="{prefill}",leg="prefill"}}' in metrics
        assert 'leg="decode"' in metrics
        assert 'smetric_request_seconds_count{api="chat"} 3.0' in metrics
        assert all(e.inflight == 0 for e in router.engines)
        assert all(e.unprefilled == 0 and e.inflight_tokens == 0 for e in router.engines)

    asyncio.run(with_pd(body))


def test_a_prefill_without_transfer_params_sends_the_plain_request_to_the_decode() -> None:
    async def body(client, url, router, cluster) -> None:
        _, data = await ask(client, url, conversation(6, 0))
        assert data["usage"]["completion_tokens"] == 4
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing pulled

    asyncio.run(with_pd(body, prefill=0, prefill_apps=(keyless_prefill_app,), decode=1))


def test_the_pull_takes_the_link_models_time() -> None:
    # 100 kB/s: a 16-token block of Qwen3-30B's KV (1.5 MB) takes 15.7 s, x speed 0.01.
    slow = {"kv_link_gb_s": 0.0001, "speed": 0.01}

    async def body(client, url, router, cluster) -> None:
        messages = conversation(1, 0)
        started = time.monotonic()
        _, data = await ask(client, url, messages)
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16 * 10
        pull_s = cached * 98_304 / 1e5 * 0.01
        assert time.monotonic() - started >= pull_s

    asyncio.run(with_pd(body, prefill=1, decode=1, decode_config=slow))


def test_a_dead_or_stalling_prefill_engine_is_skipped() -> None:
    async def body(client, url, router, cluster) -> None:
        for session in range(4):
            response, _ = await ask(client, url, conversation(session, 0))
            assert response.headers[PREFILL_HEADER] in cluster.servers  # a live one
        dead = router.engines[0]
        assert dead.healthy is False

    asyncio.run(
        with_pd(body, prefill=1, dead_prefill=1, prefill_faults=("stall",), first_byte_timeout_s=1)
    )


def test_a_dead_decode_engine_sends_the_decode_to_another_and_none_left_is_a_503() -> None:
    async def body(client, url, router, cluster) -> None:
        response, data = await ask(client, url, conversation(2, 0))
        assert response.headers[DECODE_HEADER] in cluster.servers
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # pulled, not redone

    asyncio.run(with_pd(body, decode=1, dead_decode=2))

    async def none_left(client, url, router, cluster) -> None:
        _, error = await ask(client, url, conversation(3, 0), status=503)
        assert "decode engine" in error["error"]["message"]
        assert not router.engines[-1].healthy

    asyncio.run(with_pd(none_left, decode=0, dead_decode=1))


def test_a_stalling_decode_engine_answers_504() -> None:
    async def body(client, url, router, cluster) -> None:
        _, error = await ask(client, url, conversation(4, 0), status=504)
        assert "no response within 1 s" in error["error"]["message"]
        assert all(e.inflight == 0 for e in router.engines)

    asyncio.run(with_pd(body, decode=0, decode_faults=("stall",), first_byte_timeout_s=1))


def test_engines_refuse_a_leg_their_role_cannot_serve() -> None:
    async def body(client, url, router, cluster) -> None:
        decode = next(u for u in cluster.servers if u in router.disagg.decode_urls)
        prefill = next(u for u in cluster.servers if u in router.disagg.prefill_urls)
        wrong = [
            (decode, {"do_remote_decode": True}, "decode engine"),
            (prefill, {"do_remote_prefill": True}, "prefill engine"),
        ]
        for engine, params, message in wrong:
            payload = {"messages": conversation(5, 0), KV_TRANSFER_PARAMS: params}
            async with client.post(engine + "/v1/chat/completions", json=payload) as response:
                assert response.status == 400
                assert message in (await response.json())["error"]["message"]

    asyncio.run(with_pd(body, prefill=1, decode=1))


def test_processes_engine_roles_and_serve_from_yaml(tmp_path) -> None:
    """``smetric engine --role`` and ``smetric serve`` with prefill_engines/decode_engines in
    YAML, as separate processes; the decode engine is killed and the next request still
    finds the other."""
    roles = ["prefill", "decode", "decode"]
    engines = [
        SmetricProcess(tmp_path, args=("engine", "--role", role, "--speed", "0.001"))
        for role in roles
    ]
    config = tmp_path / "pd.yaml"
    router = SmetricProcess(
        tmp_path,
        args=("serve", "-c", str(config), "--decode-policy", "round_robin",
              "--health-interval", "0.2"),
    )  # fmt: skip
    processes = [*engines, router]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_listening()
        urls = [e.url for e in engines]
        config.write_text(f"prefill_engines: [{urls[0]}]\ndecode_engines: [{urls[1]}, {urls[2]}]\n")
        router.start()
        router.wait_listening()
        urls.append(router.url)

        async def scenario() -> None:
            for url in urls:
                await wait_healthy(url)
            async with aiohttp.ClientSession() as client:
                # The router may have checked an engine before it listened: wait until it
                # has seen all three healthy.
                async with asyncio.timeout(30):
                    while True:
                        async with client.get(urls[3] + "/health") as response:
                            if (await response.json())["healthy_engines"] == 3:
                                break
                        await asyncio.sleep(0.1)
                seen = set()
                for session in range(2):
                    response, data = await ask(client, urls[3], conversation(session, 0))
                    seen.add(response.headers[DECODE_HEADER])
                    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                assert seen == set(urls[1:3])  # round-robin over both decode engines
                engines[1].kill()
                for session in range(2, 4):
                    response, _ = await ask(client, urls[3], conversation(session, 0))
                    assert response.headers[DECODE_HEADER] == urls[2]

        asyncio.run(scenario())
    finally:
        for process in processes:
            process.stop()


def test_decode_rules_read_kv_use_where_scraped_else_requests_in_flight() -> None:
    from smetric.serve.scrape import EngineReport

    busy_kv, busy_requests = Engine("http://127.0.0.1:1", 64), Engine("http://127.0.0.1:2", 64)
    busy_kv.report = EngineReport(at=time.monotonic(), kv_usage=0.9)
    busy_requests.report = EngineReport(at=time.monotonic(), kv_usage=0.1)
    busy_requests.inflight = 3
    engines = [busy_kv, busy_requests]
    router = Router(
        engines,
        disagg=Disaggregation(frozenset({"http://x:1"}), frozenset(e.url for e in engines)),
    )
    roles = router.disagg
    assert roles is not None

    def pick(rule: str) -> Engine:
        disagg = Disaggregation(roles.prefill_urls, roles.decode_urls, rule)
        return disagg.attach(router.dispatcher.wiring).choose_decode(engines)

    assert pick("least_kv") is busy_requests  # 10 % of its KV in use against 90 %
    assert pick("least_requests") is busy_kv
    busy_kv.report = EngineReport(at=time.monotonic() - 60, kv_usage=0.9)  # stale
    busy_requests.report = None
    assert pick("least_kv") is busy_kv  # no fresh scrape: requests in flight decide
    turns = Disaggregation(roles.prefill_urls, roles.decode_urls, "round_robin")
    assert [turns.choose_decode(engines) for _ in range(4)] == engines * 2
