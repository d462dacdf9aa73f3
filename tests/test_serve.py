"""The router over real HTTP on loopback: bad input, auth, failover, and (with the mock
engine) routing that lands follow-ups where their prefix is cached."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from smetric.engine.server import KV_EVENTS
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.testing.fault_suite import SmetricProcess

from conftest import closed_port, events_engine, eventually, run, until_heard, zmq_port

# A ZMQ socket bound here takes a loopback port the OS picks, read back once bound.
ANY_PORT = "tcp://127.0.0.1:*"


def events_engine_of(server: TestServer, topic: str) -> str:
    """``events_engine`` for a running mock engine that binds both its sockets."""
    publisher = server.app[KV_EVENTS]
    assert server.port is not None and publisher.replay_endpoint is not None
    ports = zmq_port(publisher.endpoint), zmq_port(publisher.replay_endpoint)
    return events_engine(server.port, *ports, topic, bind="false")


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


# -- with real mock engines ------------------------------------------------------------------

from smetric.engine import EngineConfig, create_app  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

FAST = EngineConfig(speed=0.0001, kv_blocks=4096, default_max_tokens=8)


async def with_cluster(
    n: int,
    body: Callable[[aiohttp.ClientSession, str, Router, list[TestServer]], Awaitable[Any]],
    policy: str = "smetric",
    dead: int = 0,
    engine_tokenizer: bool = False,
    **settings: Any,
) -> Any:
    """``n`` mock engines (plus ``dead`` unreachable URLs first) behind one router, with
    further ``RouterSettings`` from ``settings``."""
    engines = [TestServer(create_app(FAST), host="127.0.0.1") for _ in range(n)]
    for server in engines:
        await server.start_server()
    urls = [f"http://127.0.0.1:{closed_port()}" for _ in range(dead)]
    urls += [f"http://127.0.0.1:{s.port}" for s in engines]
    router = Router(
        [Engine(u, 1000) for u in urls],
        RouterSettings(policy=policy, health_interval_s=0.05, **settings),
        engine_tokenizer=engine_tokenizer,
    )
    server = TestServer(router.app(), host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as client:
            return await body(client, f"http://127.0.0.1:{server.port}", router, engines)
    finally:
        await server.close()
        for engine in engines:
            await engine.close()


def conversation(session: int, turns: int) -> list[dict]:
    system = {"role": "system", "content": "You are a coding agent. " * 20}
    messages = [system, {"role": "user", "content": f"task {session}: " + "fix the bug " * 30}]
    for turn in range(turns):
        messages += [
            {"role": "assistant", "content": f"step {turn} " * 10},
            {"role": "tool", "content": f"output {turn} " * 40},
        ]
    return messages


async def chat(client: aiohttp.ClientSession, url: str, messages: list[dict]) -> tuple[str, dict]:
    payload = {"model": "m", "messages": messages, "max_tokens": 4}
    async with client.post(url + "/v1/chat/completions", json=payload) as response:
        assert response.status == 200, await response.text()
        return response.headers["x-smetric-engine"], await response.json()


def test_first_turns_spread_and_follow_ups_hit_where_routed() -> None:
    async def body(client, url, router, engines) -> None:
        homes = {}
        for s in range(4):
            homes[s], _ = await chat(client, url, conversation(s, 0))
        assert len(set(homes.values())) == 2  # four first turns over two engines
        for turn in range(1, 4):
            for s in range(4):
                where, data = await chat(client, url, conversation(s, turn))
                assert where == homes[s]  # the follow-up sticks to its cache
                assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        # The router's prefix index predicts exactly what the engines report as cached.
        for engine in router.engines:
            predicted = _metric(text, "smetric_predicted_hit_tokens_total", engine.url)
            reported = _metric(text, "smetric_reported_cached_tokens_total", engine.url)
            assert predicted == reported > 0
        assert _metric(text, "smetric_routing_decisions_total", "sticky", label="branch") == 12

    run(lambda: with_cluster(2, body))


def test_streaming_passes_chunks_through_and_reports_the_engine() -> None:
    async def body(client, url, router, engines) -> None:
        payload = {"messages": conversation(0, 0), "max_tokens": 5, "stream": True}
        async with client.post(url + "/v1/chat/completions", json=payload) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            lines = [line async for line in response.content if line.strip()]
        assert lines[-1].strip() == b"data: [DONE]"
        tokens = [json.loads(line[6:]) for line in lines[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in tokens)
        assert len(text.split()) == 5

    run(lambda: with_cluster(1, body))


def test_connect_failure_retries_on_another_engine() -> None:
    async def body(client, url, router, engines) -> None:
        router.settings.health_interval_s = 60  # keep the dead engine "healthy" for the test
        for engine in router.engines:
            engine.healthy = True
        where, _ = await chat(client, url, conversation(0, 0))
        assert where == router.engines[1].url
        assert router.engines[0].healthy is False

    run(lambda: with_cluster(1, body, policy="round_robin", dead=1))


def test_engine_down_is_ejected_then_readmitted_with_a_fresh_view() -> None:
    async def body(client, url, router, engines) -> None:
        await chat(client, url, conversation(0, 0))
        victim = router.engines[0]
        port = engines[0].port
        await engines[0].close()
        await eventually(lambda: victim.healthy is False)
        where, _ = await chat(client, url, conversation(1, 0))
        assert where == router.engines[1].url  # traffic avoids the ejected engine
        revived = TestServer(create_app(FAST), host="127.0.0.1", port=port)
        await revived.start_server()
        engines[0] = revived
        await eventually(lambda: victim.healthy is True)
        assert victim.view_blocks() == 0  # what it cached before the restart is forgotten

    run(lambda: with_cluster(2, body))


def test_engine_killed_mid_stream_ends_the_stream_cleanly(tmp_path) -> None:
    """A real engine process, SIGKILLed while it streams: the client gets an error event
    and the end of the stream, never a hang, and the router's load count comes back."""
    process = SmetricProcess(tmp_path, args=("engine", "--speed", "1"))
    try:
        process.start()
        process.wait_ready(60.0)

        async def scenario() -> None:
            router = Router([Engine(process.url, 4096)], RouterSettings(health_interval_s=60))

            async def body(client: aiohttp.ClientSession, url: str) -> None:
                payload = {"messages": conversation(0, 0), "max_tokens": 5000, "stream": True}
                async with client.post(url + "/v1/chat/completions", json=payload) as response:
                    first = await response.content.readline()
                    assert first.startswith(b"data: ")
                    process.kill()
                    rest = await asyncio.wait_for(response.content.read(), timeout=10)
                event = json.loads(rest.strip().removeprefix(b"data: "))
                # OpenAI's error shape, in words a user reads: no HTTP client's internals.
                assert event["error"]["type"] == "server_error"
                assert event["error"]["code"] == 502
                assert "cut short" in event["error"]["message"]
                assert "Error" not in event["error"]["message"]  # no exception class names
                assert router.engines[0].inflight == 0
                assert router.engines[0].healthy is False

            await with_router(router, body)

        run(scenario)
    finally:
        process.stop()


async def wait_healthy(url: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as client:
        while True:
            try:
                async with client.get(url + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{url} did not become healthy")
            await asyncio.sleep(0.1)


def _metric(text: str, name: str, value: str, label: str = "engine") -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{{label}="{value}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {value} not in /metrics")


def test_demo_drives_sessions_through_router_and_engines() -> None:
    from typer.testing import CliRunner

    from smetric.cli import app

    result = CliRunner().invoke(app, ["demo", "--engines", "2", "--duration", "4"])
    assert result.exit_code == 0, result.output
    assert "0 failed" in result.output
    assert "sticky" in result.output  # follow-ups were routed to their cache


async def follow_up_while_home_streams(client, url, router, branch: str) -> dict[str, int]:
    """Turn 1 of a session sticks to its home engine and keeps streaming there while turn
    2 arrives; turn 2 must go elsewhere, through ``branch``. Returns the prompt tokens each
    engine held in flight meanwhile."""
    home, _ = await chat(client, url, conversation(0, 0))
    payload = {"messages": conversation(0, 1), "max_tokens": 50_000, "stream": True}
    async with client.post(url + "/v1/chat/completions", json=payload) as long_stream:
        assert long_stream.headers["x-smetric-engine"] == home
        await long_stream.content.readline()
        held = {e.url: e.inflight_tokens for e in router.engines}
        where, _ = await chat(client, url, conversation(0, 2))
        assert where != home
    async with client.get(url + "/metrics") as response:
        text = await response.text()
    assert _metric(text, "smetric_routing_decisions_total", branch, "branch") == 1
    assert held[home] > 0
    return held


def test_overload_guard_moves_a_follow_up_off_a_busy_engine() -> None:
    async def body(client, url, router, engines) -> None:
        # Home holds 1 request against a mean of 1/3: more than 2x the mean.
        await follow_up_while_home_streams(client, url, router, "overload_fallback")

    run(lambda: with_cluster(3, body))


def test_smetric_cost_moves_a_follow_up_off_an_engine_whose_in_flight_kv_slows_it() -> None:
    async def body(client, url, router, engines) -> None:
        # The router's in-flight prompt tokens reach the policy: at 1 s per token per
        # decode step, the home engine's streaming turn outweighs recomputing the prefix.
        held = await follow_up_while_home_streams(client, url, router, "move_recompute")
        assert sorted(held.values())[:2] == [0, 0]
        for _ in range(100):  # the closed stream's end reaches the router shortly
            if sum(e.inflight_tokens for e in router.engines) == 0:
                break
            await asyncio.sleep(0.02)
        assert sum(e.inflight_tokens for e in router.engines) == 0

    run(lambda: with_cluster(3, body, policy="smetric_cost:kv_read_s=1"))


def test_eviction_guard_rebalances_a_session_the_index_lost() -> None:
    async def body(client, url, router, engines) -> None:
        for engine in router.engines:
            engine.kv_blocks = 4  # an index too small to hold a session's history
            engine.forget()
        await chat(client, url, conversation(0, 0))
        await chat(client, url, conversation(0, 1))
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        assert _metric(text, "smetric_routing_decisions_total", "evicted_fallback", "branch") == 1

    run(lambda: with_cluster(2, body))


def test_engine_metrics_size_the_index_and_raise_the_load() -> None:
    from smetric.serve.backends import VLLM
    from smetric.serve.scrape import EngineReport

    async def body(client, url, router, engines) -> None:
        router.settings.scrape_interval_s = 0.05
        for engine in router.engines:
            await router.pool.scrape(engine)
        # The mock engine's pool: 4096 blocks of 16 tokens; the router was told 1000.
        assert [e.kv_blocks for e in router.engines] == [4096, 4096]
        async with client.get(router.engines[0].url + "/metrics") as response:
            report = VLLM.parse_metrics(await response.text(), at=0.0)
        assert (report.running, report.waiting, report.num_gpu_blocks) == (0.0, 0.0, 4096)

    async def cluster() -> None:
        await with_cluster(2, body)

    run(cluster)
    engine = Engine("http://127.0.0.1:1", 100)
    engine.inflight = 2
    engine.report = EngineReport(at=10.0, running=5.0, waiting=1.0)
    assert engine.load(now=12.0, staleness_s=5.0) == 6.0  # fresh: the engine knows more
    assert engine.load(now=20.0, staleness_s=5.0) == 2.0  # stale: only what the router sent
    with pytest.raises(ValueError):
        VLLM.parse_metrics("this is { not prometheus", at=0.0)


def test_a_restart_seen_in_the_scrape_drops_the_engine_s_view(caplog) -> None:
    """An engine back up before any health check noticed it was gone: its scraped
    process_start_time_seconds changed, so what the router remembered of it is dropped."""

    async def body(client, url, router, engines) -> None:
        router.settings.health_interval_s = 3600  # only the scrape can notice
        victim = router.engines[0]
        await router.pool.scrape(victim)
        for s in range(2):  # one session per engine
            await chat(client, url, conversation(s, 0))
        assert victim.view_blocks() > 0
        await router.pool.scrape(victim)
        assert victim.view_blocks() > 0  # the same process: nothing forgotten
        port = engines[0].port
        await engines[0].close()
        engines[0] = TestServer(create_app(FAST), host="127.0.0.1", port=port)
        await engines[0].start_server()
        await router.pool.scrape(victim)
        assert victim.healthy and victim.view_blocks() == 0

    with caplog.at_level("WARNING", logger="smetric.serve"):
        run(lambda: with_cluster(2, body))
    assert any('"engine_restarted"' in r.getMessage() for r in caplog.records)


def test_anthropic_messages_pass_through_and_follow_ups_hit() -> None:
    def turn(n: int) -> dict:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "refactor the parser " * 20}]
        for i in range(n):
            messages += [
                {"role": "assistant", "content": [{"type": "text", "text": f"step {i} " * 8}]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": f"t{i}",
                            "content": f"output {i} " * 30,
                        }
                    ],
                },
            ]
        return {
            "model": "m",
            "system": "You are Claude Code. " * 10,
            "messages": messages,
            "max_tokens": 6,
        }

    async def body(client, url, router, engines) -> None:
        async with client.post(url + "/v1/messages", json=turn(0)) as response:
            assert response.status == 200
            home = response.headers["x-smetric-engine"]
            first = await response.json()
        assert first["type"] == "message" and first["usage"]["output_tokens"] == 6
        async with client.post(url + "/v1/messages", json={**turn(1), "stream": True}) as response:
            assert response.headers["x-smetric-engine"] == home
            events = [line async for line in response.content if line.startswith(b"event: ")]
        assert events[0].strip() == b"event: message_start"
        assert events[-1].strip() == b"event: message_stop"
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        reported = _metric(text, "smetric_reported_cached_tokens_total", home)
        assert reported == _metric(text, "smetric_predicted_hit_tokens_total", home) > 0

    run(lambda: with_cluster(2, body))


def test_engine_tokenizer_gives_the_same_prediction() -> None:
    async def body(client, url, router, engines) -> None:
        home, _ = await chat(client, url, conversation(7, 0))
        where, data = await chat(client, url, conversation(7, 1))
        assert where == home
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        assert _metric(text, "smetric_predicted_hit_tokens_total", home) == cached > 0

    # Tokenised through the engines' /tokenize.
    run(lambda: with_cluster(2, body, engine_tokenizer=True))


def test_client_going_away_ends_the_request_s_load() -> None:
    async def body(client, url, router, engines) -> None:
        payload = {"messages": conversation(3, 0), "max_tokens": 50_000, "stream": True}
        response = await client.post(url + "/v1/chat/completions", json=payload)
        await response.content.readline()
        assert sum(e.inflight for e in router.engines) == 1
        response.close()  # the client hangs up mid-stream
        for _ in range(100):
            if sum(e.inflight for e in router.engines) == 0:
                break
            await asyncio.sleep(0.02)
        assert sum(e.inflight for e in router.engines) == 0

    run(lambda: with_cluster(1, body))


def test_large_prompts_are_routed_the_same_way() -> None:
    """A prompt analysed off the event loop (over 64 KiB) still sticks and hits."""

    async def body(client, url, router, engines) -> None:
        for engine in router.engines:
            await router.pool.scrape(engine)  # size the index to the engines' 4096 blocks
        big = [{"role": "user", "content": "long context " * 5000}]  # 65 KB, 65 k tokens
        home, _ = await chat(client, url, big)
        follow = [*big, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
        where, data = await chat(client, url, follow)
        assert where == home
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 60_000

    run(lambda: with_cluster(2, body))


def test_router_on_the_events_view_from_a_yaml_config(tmp_path) -> None:
    """`smetric serve --config` with kv_events: the router routes on what the engine says
    it cached, and reports the view as exact."""
    from smetric.serve.config import ServeConfig, engines_from, load_config

    # The engine binds both sockets on ports the OS picks; the router connects to them.
    config = EngineConfig(
        speed=0.0001,
        kv_events_endpoint=ANY_PORT,
        kv_events_bind=True,
        kv_events_topic="kv-a",
        kv_events_replay_endpoint=ANY_PORT,
    )

    async def scenario() -> None:
        engine_server = TestServer(create_app(config), host="127.0.0.1")
        await engine_server.start_server()
        yaml_file = tmp_path / "engines.yaml"
        yaml_file.write_text("engines:\n" + events_engine_of(engine_server, "kv-a"))
        listed = load_config(ServeConfig, yaml_file).engines
        engines, subscribers = engines_from(listed, 1000, 16)
        router = Router(engines, RouterSettings(health_interval_s=60), subscribers=subscribers)

        async def body(client: aiohttp.ClientSession, url: str) -> None:
            subscriber = subscribers[engines[0].url]

            async def warm_up(attempt: int) -> None:
                await chat(client, url, [{"role": "user", "content": f"warm-up {attempt} " * 9}])

            publisher = engine_server.app[KV_EVENTS]

            async def applied_since(heard: int) -> None:
                """A new batch arrived, and every batch published so far is applied."""
                await eventually(
                    lambda: (
                        subscriber.counters.batches > heard
                        and subscriber.tracker.last == publisher.seq - 1
                    )
                )

            await until_heard(warm_up, lambda: subscriber.counters.batches > 0)
            heard = subscriber.counters.batches
            await chat(client, url, conversation(5, 0))
            await applied_since(heard)
            heard = subscriber.counters.batches
            payload = {"model": "m", "messages": conversation(5, 1), "max_tokens": 4}
            async with client.post(url + "/v1/chat/completions", json=payload) as response:
                data = await response.json()
                header = int(response.headers["x-smetric-predicted-hit-tokens"])
            await applied_since(heard)  # so that the view's size below is final
            async with client.get(url + "/metrics") as response:
                text = await response.text()
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            predicted = _metric(text, "smetric_predicted_hit_tokens_total", engines[0].url)
            assert predicted == header == cached > 0
            url0, view = engines[0].url, engines[0].events
            assert view is not None  # the engine publishes KV events
            assert _metric(text, "smetric_engine_kv_view_exact", url0) == 1.0
            assert _metric(text, "smetric_engine_kv_view_blocks", url0) == view.size()
            batches = f'smetric_kv_events_total{{engine="{url0}",kind="batches"}}'
            assert any(
                line.startswith(batches) and float(line.split()[-1]) >= 2
                for line in text.splitlines()
            )

        try:
            await with_router(router, body)
        finally:
            await engine_server.close()

    run(scenario)


def test_stateless_replicas_keep_a_session_on_one_engine(tmp_path) -> None:
    """Two routers sharing nothing, both on the engines' KV events: a session whose turns
    alternate between them still sticks to one engine (the paper: no session table)."""
    from smetric.serve.config import ServeConfig, engines_from, load_config

    configs = [
        EngineConfig(
            speed=0.0001,
            kv_events_endpoint=ANY_PORT,
            kv_events_bind=True,
            kv_events_topic=f"kv-{i}",
            kv_events_replay_endpoint=ANY_PORT,
        )
        for i in range(2)
    ]

    async def scenario() -> None:
        servers = [TestServer(create_app(c), host="127.0.0.1") for c in configs]
        for server in servers:
            await server.start_server()
        yaml_file = tmp_path / "engines.yaml"
        yaml_file.write_text(
            "engines:\n"
            + "".join(events_engine_of(server, f"kv-{i}") for i, server in enumerate(servers))
        )
        replicas, listening = [], []
        for _ in range(2):
            listed = load_config(ServeConfig, yaml_file).engines
            engines, subscribers = engines_from(listed, 1000, 16)
            router = Router(engines, RouterSettings(health_interval_s=60), subscribers=subscribers)
            replica = TestServer(router.app(), host="127.0.0.1")
            await replica.start_server()
            replicas.append(replica)
            listening += [
                (subscriber, server.app[KV_EVENTS])
                for subscriber, server in zip(subscribers.values(), servers, strict=True)
            ]
        fronts = [f"http://127.0.0.1:{r.port}" for r in replicas]

        def caught_up() -> bool:
            """Every replica has applied every batch of every engine."""
            return all(sub.tracker.last == pub.seq - 1 for sub, pub in listening)

        try:
            async with aiohttp.ClientSession() as client:

                async def warm_up(attempt: int) -> None:
                    body = {"prompt": f"warm-up {attempt} " * 9, "max_tokens": 1}
                    for server in servers:
                        url = f"http://127.0.0.1:{server.port}/v1/completions"
                        async with client.post(url, json=body) as response:
                            assert response.status == 200

                await until_heard(warm_up, caught_up)
                served = []
                for turn in range(5):
                    front = fronts[turn % 2]  # alternate between the two replicas
                    where, data = await chat(client, front, conversation(9, turn))
                    served.append(where)
                    if turn:
                        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                    for _ in range(250):  # the engine's BlockStored reaches both replicas
                        if caught_up():
                            break
                        await asyncio.sleep(0.02)
            assert len(set(served)) == 1
        finally:
            for server in [*replicas, *servers]:
                await server.close()

    run(scenario)
