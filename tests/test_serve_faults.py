"""The router under engine faults, client hang-ups and hostile input, over real HTTP on
loopback: misbehaving engines (``smetric.testing.faulty``) beside real mock engines, and
clients that time out, reset or send what no SDK would."""

from __future__ import annotations

import asyncio
import base64
import functools
import gzip
import json
import os
import re
import socket
import struct
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, TypedDict

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from test_serve import CHAT, FAST, conversation

from smetric.core.blocks import ByteTokenizer, Tokenizer
from smetric.engine import EngineConfig, create_app
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.serve.forwarding import Completion, Outcome
from smetric.testing.engines import metric
from smetric.testing.faulty import Fault, FaultyEngine

from conftest import eventually, router_client, run

pytestmark = pytest.mark.server


class Timeouts(TypedDict, total=False):
    """Router settings in seconds, as tests pass them on to ``RouterSettings``."""

    connect_timeout_s: float
    first_byte_timeout_s: float
    idle_timeout_s: float
    health_interval_s: float


# Timeouts a busy machine never reaches with a mock engine, and quick health checks...
QUICK: Timeouts = {"first_byte_timeout_s": 10, "idle_timeout_s": 10, "health_interval_s": 0.05}
# ...and a router that gives up on a silent engine quickly, so those tests stay short.
IMPATIENT: Timeouts = {"first_byte_timeout_s": 0.5, "idle_timeout_s": 0.5}


async def with_mixed(
    faults: list[Fault],
    healthy: int,
    body: Callable[..., Awaitable[Any]],
    engine_config: EngineConfig = FAST,
    handler_cancellation: bool = True,
    tokenizer: Tokenizer | None = None,
    **settings: Any,
) -> Any:
    """Faulty engines first, then ``healthy`` mock engines, behind one router;
    ``body(client, url, router, fakes)``. Every request must end within 30 s."""
    fakes = [await FaultyEngine(fault).start() for fault in faults]
    mocks = [TestServer(create_app(engine_config), host="127.0.0.1") for _ in range(healthy)]
    for mock in mocks:
        await mock.start_server()
    urls = [f.url for f in fakes] + [f"http://127.0.0.1:{m.port}" for m in mocks]
    router = Router(
        [Engine(u, 1000) for u in urls],
        RouterSettings(**{**QUICK, **settings}),
        tokenizer=tokenizer or ByteTokenizer(),
    )
    try:
        async with router_client(router.app(), handler_cancellation, 30) as (client, url):
            return await body(client, url, router, fakes)
    finally:
        for fake in fakes:
            await fake.close()
        for mock in mocks:
            await mock.close()


async def assert_openai_error(response: aiohttp.ClientResponse, status: int) -> dict:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    error = (await response.json())["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


async def assert_anthropic_error(response: aiohttp.ClientResponse, status: int, kind: str) -> dict:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    answer = await response.json()
    assert answer["type"] == "error" and answer["error"]["type"] == kind
    assert answer["error"]["message"]
    return answer["error"]


async def first_turn(
    client: aiohttp.ClientSession, url: str, session: int, messages: list[dict] | None = None
) -> str:
    """Session ``session``'s first chat turn (or ``messages``), which must succeed; the
    engine that served it."""
    payload = {**CHAT, "messages": messages or conversation(session, 0)}
    async with client.post(url + "/v1/chat/completions", json=payload) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["choices"]
        return response.headers["x-smetric-engine"]


def no_load_left(router: Router) -> Callable[[], bool]:
    return lambda: all(e.inflight == 0 for e in router.engines)


# -- finding 1: load comes down on every exit path -----------------------------------------


def test_clients_timing_out_before_the_headers_leave_no_load() -> None:
    """Non-streaming replies send their headers only at the end: clients that give up
    first cancel the router's handler while it waits for them."""
    slow = EngineConfig(speed=1.0, default_max_tokens=8)

    async def body(client, url, router, fakes) -> None:
        payload = {"messages": conversation(0, 0), "max_tokens": 2000}
        quick = aiohttp.ClientTimeout(total=0.3)

        async def give_up() -> None:
            try:
                async with client.post(
                    url + "/v1/chat/completions", json=payload, timeout=quick
                ) as response:
                    await response.read()
            except TimeoutError:
                return
            raise AssertionError("the engine answered before the client gave up")

        await asyncio.gather(*(give_up() for _ in range(6)))
        await eventually(no_load_left(router), timeout_s=5)
        assert all(e.healthy for e in router.engines)  # a client's impatience is no fault

    run(lambda: with_mixed([], 2, body, engine_config=slow, first_byte_timeout_s=60))


def test_a_non_http_reply_leaves_no_load_and_a_json_502() -> None:
    async def body(client, url, router, fakes) -> None:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            await assert_openai_error(response, 502)
        assert router.engines[0].inflight == 0

    run(lambda: with_mixed(["garbage"], 0, body))


# -- finding 2: timeouts ------------------------------------------------------------------


def test_a_stalled_engine_times_out_and_the_request_is_retried_elsewhere() -> None:
    async def body(client, url, router, fakes) -> None:
        for s in range(4):  # round robin: half of them go to the stalled engine first
            assert await first_turn(client, url, s) == router.engines[1].url
        assert fakes[0].generations >= 1
        await eventually(no_load_left(router))

    # Patient enough for the mock engine on a busy machine, impatient with the stalled one.
    run(lambda: with_mixed(["stall"], 1, body, policy="round_robin", first_byte_timeout_s=1.5))


def test_with_only_a_stalled_engine_the_client_gets_a_clean_504() -> None:
    async def body(client, url, router, fakes) -> None:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            await assert_openai_error(response, 504)
        async with client.get(url + "/v1/models") as response:  # the fan-out is bounded too
            assert response.status == 200
            assert (await response.json())["data"] == []
        await eventually(no_load_left(router))

    run(lambda: with_mixed(["stall"], 0, body, **IMPATIENT))


def test_a_stream_that_goes_silent_ends_with_an_error_event() -> None:
    async def body(client, url, router, fakes) -> None:
        payload = {**CHAT, "stream": True}
        async with client.post(url + "/v1/chat/completions", json=payload) as response:
            assert response.status == 200
            text = (await response.read()).decode()
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        assert "hi" in events[0]
        assert json.loads(events[-1][6:])["error"]["type"] == "server_error"
        assert "[DONE]" not in text
        await eventually(no_load_left(router))

    run(lambda: with_mixed(["stall_mid_stream"], 0, body, **IMPATIENT))


def test_more_concurrent_streams_than_a_connection_pool_holds_all_start() -> None:
    """No hidden cap on connections to the engines: the 101st stream is not queued in the
    router past its first-byte timeout (and blamed on the engine). The engine's pool holds
    all 110 (a stream sends nothing before its first token, so one the engine queued would
    time out too); each then decodes for tens of seconds, longer than the test holds it."""
    slow = EngineConfig(speed=1.0, default_max_tokens=8, kv_blocks=32_768)

    async def body(client, url, router, fakes) -> None:
        payload = {"messages": conversation(2, 0), "max_tokens": 2_000, "stream": True}
        streams = [await client.post(url + "/v1/chat/completions", json=payload)]
        streams += await asyncio.gather(
            *(client.post(url + "/v1/chat/completions", json=payload) for _ in range(109))
        )
        try:
            assert [r.status for r in streams] == [200] * 110
            assert router.engines[0].inflight == 110
        finally:
            for response in streams:
                response.close()
        await eventually(no_load_left(router))

    timeouts: Timeouts = {"first_byte_timeout_s": 5, "idle_timeout_s": 30}
    run(lambda: with_mixed([], 1, body, engine_config=slow, **timeouts))


# -- finding 3: client resets are not engine faults ---------------------------------------


def reset(response: aiohttp.ClientResponse) -> None:
    """Hang up with a TCP reset (SO_LINGER 0), as a killed client process does."""
    assert response.connection is not None
    transport = response.connection.transport
    assert transport is not None
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def test_client_resets_mid_stream_never_eject_an_engine() -> None:
    async def body(client, url, router, fakes) -> None:
        payload = {"messages": conversation(1, 0), "max_tokens": 50_000, "stream": True}
        for _ in range(6):
            response = await client.post(url + "/v1/chat/completions", json=payload)
            assert response.status == 200, await response.text()
            await response.content.readline()
            reset(response)
        await eventually(no_load_left(router))
        await asyncio.sleep(0.2)  # writes to the gone clients have failed by now
        assert all(e.healthy for e in router.engines)
        # The router hung up on the engines too, so they stopped generating.
        for engine in router.engines:
            async with client.get(engine.url + "/metrics") as response:
                text = await response.text()
            assert metric(text, "vllm:num_requests_running") == 0

    # Without handler cancellation (as under gunicorn), the router's next write to the
    # client is what finds it gone.
    run(lambda: with_mixed([], 2, body, handler_cancellation=False, health_interval_s=60))


# -- finding 4: passive health ------------------------------------------------------------


def test_an_engine_failing_every_request_is_ejected_and_its_requests_retried() -> None:
    async def body(client, url, router, fakes) -> None:
        for s in range(30):
            await first_turn(client, url, s)
        bad = router.engines[0]
        assert not bad.healthy  # ejected although its /health answers 200...
        await asyncio.sleep(0.3)  # ...and kept out by the backoff, past several checks
        assert not bad.healthy
        assert fakes[0].generations == 3  # the failures it took to eject it
        assert all(e.healthy for e in router.engines[1:])
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        kind = "status" if fakes[0].fault == "http_500" else "protocol"
        labels = f'engine="{bad.url}",kind="{kind}"'
        assert f"smetric_engine_failures_total{{{labels}}} 3.0" in text
        assert "smetric_retries_total 3.0" in text

    faults: tuple[Fault, ...] = ("http_500", "garbage")
    for fault in faults:
        run(functools.partial(with_mixed, [fault], 2, body, policy="least_load"))


def test_an_ejected_engine_is_readmitted_after_its_backoff() -> None:
    async def body(client, url, router, fakes) -> None:
        for s in range(20):
            await first_turn(client, url, s)
            if not router.engines[0].healthy:
                break
        assert fakes[0].generations == 3
        await eventually(lambda: router.engines[0].healthy, timeout_s=5)

    run(lambda: with_mixed(["http_500"], 1, body, policy="round_robin", eject_backoff_s=0.5))


# -- finding 5: every error is an OpenAI-style JSON body ----------------------------------


def test_hostile_bodies_get_json_4xx_never_a_traceback() -> None:
    deep = b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    huge_int = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000
    huge_int += b"}"
    cases = [(deep, {}), (huge_int, {}), (b"not gzip at all", {"Content-Encoding": "gzip"})]

    async def body(client, url, router, fakes) -> None:
        for payload, headers in cases:
            async with client.post(
                url + "/v1/chat/completions", data=payload, headers=headers
            ) as response:
                await assert_openai_error(response, 400)
        bomb = gzip.compress(b" " * (4 << 20))  # 4 KiB that inflate past the body limit
        async with client.post(
            url + "/v1/chat/completions", data=bomb, headers={"Content-Encoding": "gzip"}
        ) as response:
            await assert_openai_error(response, 413)
        async with client.post(
            url + "/v1/chat/completions", data=b"xyz", headers={"Content-Encoding": "br"}
        ) as response:
            await assert_openai_error(response, 415)
        for encoding in ("gzip", "deflate"):  # a well-formed compressed body is fine
            packed = (gzip.compress if encoding == "gzip" else zlib.compress)(
                json.dumps(CHAT).encode()
            )
            async with client.post(
                url + "/v1/chat/completions", data=packed, headers={"Content-Encoding": encoding}
            ) as response:
                assert response.status == 200, await response.text()

    run(lambda: with_mixed([], 1, body, max_body_bytes=1 << 20))


def test_an_engine_s_plain_text_error_reaches_the_client_as_json() -> None:
    async def body(client, url, router, fakes) -> None:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            error = await assert_openai_error(response, 413)
        assert "Request Entity Too Large" in error["message"]
        assert router.engines[0].healthy  # the client's request was at fault
        assert router.engines[0].view_blocks() == 0

    run(lambda: with_mixed(["text_413"], 0, body))


# -- finding 12: broken responses -------------------------------------------------------


def test_a_truncated_json_reply_is_never_passed_on_as_a_200() -> None:
    async def alone(client, url, router, fakes) -> None:
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            await assert_openai_error(response, 502)
        assert router.engines[0].view_blocks() == 0  # nothing was cached there

    async def beside_a_good_one(client, url, router, fakes) -> None:
        for s in range(2):
            await first_turn(client, url, s)

    run(lambda: with_mixed(["truncated_json"], 0, alone))
    run(lambda: with_mixed(["truncated_json"], 1, beside_a_good_one, policy="round_robin"))


def test_a_stream_cut_by_the_engine_ends_with_an_error_event_and_no_done() -> None:
    async def body(client, url, router, fakes) -> None:
        async with client.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            text = (await r.read()).decode()
        assert "engine" in json.loads(text.strip().splitlines()[-1][6:])["error"]["message"]
        assert "[DONE]" not in text
        assert router.engines[0].inflight == 0

    run(lambda: with_mixed(["broken_stream"], 0, body))


# -- finding 10: auth ---------------------------------------------------------------------


def test_every_route_but_health_needs_the_key() -> None:
    async def body(client, url, router, fakes) -> None:
        for method, path in [("GET", "/metrics"), ("GET", "/v1/models")]:
            async with client.request(method, url + path, json=CHAT) as response:
                await assert_openai_error(response, 401)
        async with client.post(url + "/v1/messages", json=CHAT) as response:
            await assert_anthropic_error(response, 401, "authentication_error")
        async with client.get(url + "/health") as response:
            assert response.status == 200
        accepted = [
            {"Authorization": "Bearer s3cret"},
            {"Authorization": "bearer s3cret"},  # the scheme is case-insensitive
            {"x-api-key": "s3cret"},
            {"Authorization": "Bearer wrong", "x-api-key": "s3cret"},
        ]
        for headers in accepted:
            async with client.get(url + "/v1/models", headers=headers) as response:
                assert response.status == 200, headers
        refused = [
            {"Authorization": "s3cret"},  # no scheme
            {"Authorization": "Basic s3cret"},
            {"Authorization": "Bearer s3cre"},
            {"x-api-key": "S3CRET"},  # keys are case-sensitive
            {"x-api-key": ""},
            {"Authorization": "Bearer "},
        ]
        for headers in refused:
            async with client.get(url + "/v1/models", headers=headers) as response:
                await assert_openai_error(response, 401)

    run(lambda: with_mixed([], 1, body, api_keys=frozenset({"s3cret"})))


def test_metrics_can_be_opened_to_a_scraper() -> None:
    async def body(client, url, router, fakes) -> None:
        async with client.get(url + "/metrics") as response:
            assert response.status == 200
        async with client.get(url + "/v1/models") as response:
            assert response.status == 401

    run(lambda: with_mixed([], 1, body, api_keys=frozenset({"k"}), open_metrics=True))


# -- finding 6: prompt size ---------------------------------------------------------------


def test_prompts_longer_than_the_engines_take_are_refused_by_their_token_count() -> None:
    small = EngineConfig(speed=0.0001, kv_blocks=64, default_max_tokens=4)  # 1,024 tokens

    async def body(client, url, router, fakes) -> None:
        await eventually(lambda: router.analyzer.max_prompt_tokens() == 1024)
        # Over 16 characters a token: refused before it is tokenised...
        for words in (2_000, 200_000):  # 22 kB and 2.2 MB, both under the body limit
            long = {"messages": [{"role": "user", "content": "many words " * words}]}
            async with client.post(url + "/v1/chat/completions", json=long) as response:
                error = await assert_openai_error(response, 400)
            assert "1024 tokens" in error["message"] and "--max-prompt-tokens" in error["message"]
        # ...and a prompt within that but over 1,024 tokens once tokenised, after.
        split = {"messages": [{"role": "user", "content": "x" * 700} for _ in range(3)]}
        async with client.post(url + "/v1/chat/completions", json=split) as response:
            error = await assert_openai_error(response, 400)
        assert "tokens, over the engines' longest context (1024 tokens" in error["message"]
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            assert response.status == 200
        text = router.metrics.exposition(router.engines).decode()
        assert (
            'smetric_refused_requests_total{reason="prompt_too_long",'
            'route="/v1/chat/completions",status="400"} 3.0'
        ) in text

    run(lambda: with_mixed([], 1, body, engine_config=small))


def test_a_configured_prompt_cap_wins() -> None:
    async def body(client, url, router, fakes) -> None:
        long = {"prompt": "x" * 40_000}
        async with client.post(url + "/v1/completions", json=long) as response:
            error = await assert_openai_error(response, 400)
        assert "--max-prompt-tokens (1000 tokens)" in error["message"]

    run(lambda: with_mixed([], 1, body, max_prompt_tokens=1000))


def test_the_body_limit_is_the_flag_s_whatever_the_prompt_limit() -> None:
    """A 900 kB screenshot with a few words fits an 8 k-token prompt limit: an image
    counts as its placeholder, not its base64; only --max-body-bytes limits the bytes."""
    screenshot = base64.b64encode(os.urandom(700 << 10)).decode()
    content = [
        {"type": "text", "text": "what is on screen?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{screenshot}"}},
    ]
    request = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}

    async def body(client, url, router, fakes) -> None:
        async with client.post(url + "/v1/chat/completions", json=request) as response:
            assert response.status == 200, await response.text()
        over = {"messages": [{"role": "user", "content": "x" * (6 << 20)}]}
        async with client.post(url + "/v1/chat/completions", json=over) as response:
            error = await assert_openai_error(response, 413)
        assert error["message"] == (
            f"request body too large: over --max-body-bytes ({5 << 20} bytes)"
        )

    run(lambda: with_mixed([], 1, body, max_prompt_tokens=8192, max_body_bytes=5 << 20))


# -- configuration ------------------------------------------------------------------------


def test_the_config_s_router_section_is_checked(tmp_path) -> None:
    from smetric.serve.config import ServeConfig, load_config, router_settings

    config = tmp_path / "router.yaml"
    config.write_text("engines: [http://127.0.0.1:1]\nrouter: {idle_timeout_s: 5, retries: 0}\n")
    settings = router_settings(load_config(ServeConfig, config).router)
    assert (settings.idle_timeout_s, settings.retries) == (5, 0)
    assert settings.eject_after == RouterSettings().eject_after
    for bad, key in [
        ("{idle_timeout: 5}", "router.idle_timeout'"),
        ("{retries: -1}", "router.retries must lie in [0, inf]"),
        ("{retries: 1.5}", "router.retries must be an integer"),
        ("{open_metrics: 1}", "router.open_metrics must be true or false"),
    ]:
        config.write_text(f"router: {bad}\n")
        with pytest.raises(ValueError, match=re.escape(f"{config}: ") + ".*" + re.escape(key)):
            load_config(ServeConfig, config)


def test_backoff_doubles_per_ejection_not_per_failed_request() -> None:
    from smetric.serve.outliers import OutlierDetector

    outliers = OutlierDetector(threshold=3, backoff_s=5.0, max_backoff_s=12.0)
    assert [outliers.failed("e", 0.0) for _ in range(3)] == [None, None, 5.0]
    # Requests that were in flight when it was ejected fail too: the same incident.
    assert [outliers.failed("e", 1.0) for _ in range(50)] == [None] * 50
    assert not outliers.may_readmit("e", 4.9) and outliers.may_readmit("e", 5.0)
    assert [outliers.failed("e", 6.0) for _ in range(3)] == [None, None, 10.0]
    assert [outliers.failed("e", 17.0) for _ in range(3)] == [None, None, 12.0]  # capped
    outliers.succeeded("e")  # a success forgives everything
    assert [outliers.failed("e", 30.0) for _ in range(3)] == [None, None, 5.0]


def test_large_prompts_are_analysed_a_few_at_a_time() -> None:
    """Each large prompt holds its tokens while analysed in a worker thread: at most
    ``analysis_threads`` at once, however many arrive together."""

    class Overlap:
        """The byte tokenizer, noting how many threads were inside it at once."""

        name = "bytes"

        def __init__(self) -> None:
            self.inside = self.most = 0
            self.lock = threading.Lock()

        def encode(self, text: str) -> bytes:
            with self.lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            time.sleep(0.05)  # long enough for concurrent analyses to overlap
            with self.lock:
                self.inside -= 1
            return ByteTokenizer().encode(text)

    tokenizer = Overlap()

    async def body(client, url, router, fakes) -> None:
        big = [{"role": "user", "content": "long context " * 6000}]  # 78 KB: off the loop
        await asyncio.gather(*(first_turn(client, url, 0, big) for _ in range(6)))
        assert tokenizer.most == 2

    roomy = EngineConfig(speed=0.0001, kv_blocks=8192, default_max_tokens=4)  # 128 k
    run(
        lambda: with_mixed(
            [], 1, body, engine_config=roomy, tokenizer=tokenizer, analysis_threads=2
        )
    )


def test_an_unreachable_engine_answers_503_even_before_a_health_check() -> None:
    async def body(client, url, router, fakes) -> None:
        await fakes[0].close()  # nothing listens there any more
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            error = await assert_openai_error(response, 503)
        assert "connect failed" in error["message"]
        assert not router.engines[0].healthy

    run(lambda: with_mixed(["http_500"], 0, body, health_interval_s=60))


def test_whoever_ends_a_request_sets_its_outcome() -> None:
    """Each way a request ends names its own ``Outcome`` (none is a default): the engine's
    whole reply, the engine's 4xx passed on, a stream cut mid-way, an engine's failure as
    the client's error."""

    async def ask(client, url, router, payload: dict) -> Outcome | None:
        ended: list[Completion] = []
        router.observers.append(ended.append)
        async with client.post(url + "/v1/chat/completions", json=payload) as response:
            await response.read()
        await eventually(lambda: len(ended) == 1)
        router.observers.remove(ended.append)
        return ended[0].outcome

    async def healthy(client, url, router, fakes) -> None:
        assert await ask(client, url, router, CHAT) is Outcome.COMPLETED
        refused = {**CHAT, "max_tokens": -1}  # the engine's to judge: its 400
        assert await ask(client, url, router, refused) is Outcome.ENGINE_ERROR

    async def cut(client, url, router, fakes) -> None:
        assert await ask(client, url, router, {**CHAT, "stream": True}) is Outcome.CUT

    async def garbage(client, url, router, fakes) -> None:
        assert await ask(client, url, router, CHAT) is Outcome.ENGINE_ERROR

    run(lambda: with_mixed([], 1, healthy))
    run(lambda: with_mixed(["stall_mid_stream"], 0, cut, **IMPATIENT))
    run(lambda: with_mixed(["garbage"], 0, garbage))
