"""Stalled engines found by their progress, streams by their headers, and engines joining
and leaving the pool at runtime; real HTTP on loopback, a stalled engine from
``smetric.testing.faulty`` beside mock engines."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestServer
from test_serve import CHAT, FAST, conversation
from test_serve_faults import Timeouts, no_load_left, with_mixed

from smetric.engine import EngineConfig, create_app
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.testing.engines import metric

from conftest import eventually, router_client, run

pytestmark = pytest.mark.server

# As a user who sets no timeouts gets them: a first byte may take 300 s.
PATIENT: Timeouts = {"first_byte_timeout_s": 300, "idle_timeout_s": 60}


async def ask(client, url: str, i: int, stream: bool) -> tuple[int, str, bytes]:
    payload = {**CHAT, "messages": conversation(i, 0), "stream": stream}
    async with client.post(url + "/v1/chat/completions", json=payload) as response:
        return response.status, response.headers.get("x-smetric-engine", ""), await response.read()


def test_a_stalled_engine_is_ejected_by_its_progress_and_its_requests_served_elsewhere() -> None:
    """Non-streaming requests cannot be told from long generations by their own bytes;
    the stalled engine's counters (it answers no /metrics) and silence tell."""

    async def body(client, url, router, fakes) -> None:
        started = time.monotonic()
        answers = await asyncio.gather(*(ask(client, url, i, i % 2 == 0) for i in range(8)))
        took = time.monotonic() - started
        assert fakes[0].generations > 0  # the stalled engine did get some of them
        assert all(status == 200 for status, _, _ in answers), answers
        good = router.engines[1].url
        assert {where for _, where, _ in answers} == {good}
        assert all(b"[DONE]" in raw for i, (_, _, raw) in enumerate(answers) if i % 2 == 0)
        assert took < 30  # the stall timeout and a retry, not the 300 s first-byte timeout
        assert not router.engines[0].healthy
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        assert metric(text, "smetric_engine_stalls_total", engine=router.engines[0].url) >= 1
        await eventually(no_load_left(router))

    run(
        lambda: with_mixed(
            ["stall"],
            1,
            body,
            stall_timeout_s=1.0,
            stream_headers_timeout_s=300,
            eject_backoff_s=60,
            **PATIENT,
        )
    )


def test_a_stream_without_headers_is_retried_after_the_stream_headers_timeout() -> None:
    async def body(client, url, router, fakes) -> None:
        started = time.monotonic()
        answers = await asyncio.gather(*(ask(client, url, i, True) for i in range(4)))
        assert fakes[0].generations > 0
        assert all(status == 200 and b"[DONE]" in raw for status, _, raw in answers), answers
        assert time.monotonic() - started < 20
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        stalled = router.engines[0].url
        assert metric(text, "smetric_engine_failures_total", engine=stalled, kind="timeout") >= 1
        await eventually(no_load_left(router))

    # Stall detection off: only the headers timeout can save these streams.
    run(
        lambda: with_mixed(
            ["stall"], 1, body, stall_timeout_s=0, stream_headers_timeout_s=0.5, **PATIENT
        )
    )


def test_a_long_generation_whose_counters_move_is_not_a_stall() -> None:
    """No byte for seconds (a non-streaming reply comes whole), but the engine's
    generation counter moves in its /metrics: it is working, not stalled."""
    slow = EngineConfig(speed=1.0, default_max_tokens=8)

    async def body(client, url, router, fakes) -> None:
        payload = {**CHAT, "messages": conversation(0, 0), "max_tokens": 400}
        started = time.monotonic()
        async with client.post(url + "/v1/chat/completions", json=payload) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["usage"]["completion_tokens"] == 400
        assert time.monotonic() - started > 3 * router.settings.stall_timeout_s  # meaningful
        assert router.engines[0].healthy
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        assert metric(text, "smetric_engine_stalls_total") == 0

    run(lambda: with_mixed([], 1, body, engine_config=slow, stall_timeout_s=0.5, **PATIENT))


def test_a_long_prefill_is_not_a_stall() -> None:
    """A prompt's prefill sends no byte and moves no counter (vLLM counts prompt tokens at
    the first token) for seconds: the engine has the prompt's tokens to work through, so
    its silence is no stall, and nothing is retried."""
    slow = EngineConfig(speed=3.0, default_max_tokens=8)

    async def body(client, url, router, fakes) -> None:
        messages = [{"role": "user", "content": "long context " * 1_000}]  # 13 k tokens
        payload = {**CHAT, "messages": messages, "max_tokens": 2, "stream": True}
        started = time.monotonic()
        async with client.post(url + "/v1/chat/completions", json=payload) as response:
            assert response.status == 200, await response.text()
            assert b"[DONE]" in await response.read()
        assert time.monotonic() - started > 3 * router.settings.stall_timeout_s  # meaningful
        assert router.engines[0].healthy
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        assert metric(text, "smetric_engine_stalls_total") == 0
        assert metric(text, "smetric_retries_total") == 0

    run(lambda: with_mixed([], 1, body, engine_config=slow, stall_timeout_s=0.5, **PATIENT))


def test_engines_join_and_leave_at_runtime_and_those_that_stay_keep_their_views() -> None:
    async def scenario() -> None:
        mocks = [TestServer(create_app(FAST), host="127.0.0.1") for _ in range(2)]
        for mock in mocks:
            await mock.start_server()
        first, second = (f"http://127.0.0.1:{m.port}" for m in mocks)
        router = Router([Engine(first, 1000)], RouterSettings(health_interval_s=0.05))
        try:
            async with router_client(router.app(), True, 30) as (client, url):
                assert (await ask(client, url, 0, False))[1] == first
                held = router.engines[0].view_blocks()
                assert held > 0
                await router.pool.add(Engine(second, 1000))
                assert [e.number for e in router.engines] == [0, 1]
                assert router.engines[0].view_blocks() == held  # the one that stayed
                # A new session goes to the idle newcomer; the old one stays home.
                assert (await ask(client, url, 1, False))[1] == second
                await router.pool.remove(first)
                assert (await ask(client, url, 0, False))[1] == second
                assert router.engines[0].number == 1
                async with client.get(url + "/metrics") as response:
                    text = await response.text()
                assert first not in text and second in text
                async with client.get(url + "/health") as response:
                    assert (await response.json())["healthy_engines"] == 1
        finally:
            for mock in mocks:
                await mock.close()

    run(scenario)
