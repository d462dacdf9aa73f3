"""The front door over real HTTP on loopback, with the real OpenAI and Anthropic SDKs:
every refusal counted and logged with its reason, each API's own error shape before the
headers and mid-stream, and the status codes each SDK turns into its exception types."""

from __future__ import annotations

import gzip
import json
import logging

import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types.responses import ResponseErrorEvent
from test_serve_faults import with_mixed

from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.serve.errors import ANTHROPIC, OPENAI, RESPONSES, dialect_for
from smetric.serve.refusals import Refusal, RefusalLog

from conftest import eventually, router_client, run

MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}


def ask_anthropic(sdk: anthropic.AsyncAnthropic, content: str = "hello", stream: bool = False):
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": content}]
    return sdk.messages.create(model="m", max_tokens=4, messages=messages, stream=stream)


def ask_openai(sdk: openai.AsyncOpenAI, stream: bool = False):
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hello"}
    ]
    return sdk.chat.completions.create(model="m", max_tokens=4, messages=messages, stream=stream)


def refused_count(router, route: str, status: int, reason: str) -> float:
    value = router.metrics.registry.get_sample_value(
        "smetric_refused_requests_total", {"route": route, "status": str(status), "reason": reason}
    )
    return value or 0.0


@pytest.mark.server
def test_every_refusal_is_counted_by_route_status_and_reason() -> None:
    over = b'{"messages": [{"role": "user", "content": "' + b"x" * 2048 + b'"}]}'
    cases = [
        ("/v1/chat/completions", b"{not json", {}, 400, "bad_json"),
        ("/v1/chat/completions", b"[1, 2]", {}, 400, "not_an_object"),
        ("/v1/chat/completions", b'{"model": "m"}', {}, 400, "bad_request"),
        ("/v1/messages", b"{}", {}, 400, "bad_request"),
        ("/v1/chat/completions", over, {}, 413, "body_too_large"),
        (
            "/v1/chat/completions",
            gzip.compress(over),
            {"Content-Encoding": "gzip"},
            413,
            "body_too_large",
        ),
        ("/v1/chat/completions", b"{}", {"Content-Encoding": "br"}, 415, "unsupported_encoding"),
        ("/v1/nowhere", b"{}", {}, 404, "unknown_route"),
    ]

    async def body(client, url, router, fakes) -> None:
        for path, data, headers, status, _ in cases:
            headers = {"Content-Type": "application/json", **headers}
            async with client.post(url + path, data=data, headers=headers) as response:
                assert response.status == status, (path, data[:40], await response.text())
        for path, _, _, status, reason in cases:
            route = "other" if path == "/v1/nowhere" else path
            assert refused_count(router, route, status, reason) >= 1, (route, status, reason)
        # A GET on a POST route, and the 413 named by its flag.
        async with client.get(url + "/v1/chat/completions") as response:
            assert response.status == 405
        assert refused_count(router, "/v1/chat/completions", 405, "method_not_allowed") == 1
        async with client.post(url + "/v1/chat/completions", data=over) as response:
            message = (await response.json())["error"]["message"]
        assert message == "request body too large: over --max-body-bytes (1024 bytes)"

    run(lambda: with_mixed([], 1, body, max_body_bytes=1024))


@pytest.mark.server
def test_bad_keys_and_no_healthy_engine_are_counted_too() -> None:
    async def keyed(client, url, router, fakes) -> None:
        async with client.post(url + "/v1/messages", json=MESSAGES) as response:
            assert response.status == 401
        assert refused_count(router, "/v1/messages", 401, "bad_key") == 1

    async def none_healthy(client, url, router, fakes) -> None:
        for engine in router.engines:
            engine.healthy = False
        async with client.post(url + "/v1/messages", json=MESSAGES) as response:
            assert response.status == 503
            answer = await response.json()
        assert answer["error"]["type"] == "overloaded_error"
        assert refused_count(router, "/v1/messages", 503, "no_healthy_engine") == 1

    run(lambda: with_mixed([], 1, keyed, api_keys=frozenset({"k"})))
    run(lambda: with_mixed([], 1, none_healthy, health_interval_s=60))


def test_refusals_are_logged_at_most_once_per_reason_a_second(caplog) -> None:
    class Counted:
        def labels(self, *labels: str) -> Counted:
            return self

        def inc(self) -> None:
            pass

    refusals = RefusalLog(Counted(), interval_s=60)  # type: ignore[arg-type]
    secret = "sk-do-not-log"
    with caplog.at_level(logging.WARNING, "smetric.serve"):
        for _ in range(5):
            refusals.note("/v1/messages", Refusal(401, "bad_key", f"bad key {secret}"))
        refusals.note("/v1/secret-path-" + secret, Refusal(404, "unknown_route", secret))
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    assert [(line["reason"], line["route"], line["status"]) for line in lines] == [
        ("bad_key", "/v1/messages", 401),
        ("unknown_route", "other", 404),
    ]
    assert secret not in caplog.text
    refusals.interval_s = 0
    with caplog.at_level(logging.WARNING, "smetric.serve"):
        refusals.note("/v1/messages", Refusal(401, "bad_key", "again"))
    assert json.loads(caplog.records[-1].getMessage())["suppressed"] == 4


# -- error shapes, through the SDKs ---------------------------------------------------------


@pytest.mark.server
@pytest.mark.subprocess
def test_a_stream_cut_mid_way_raises_in_the_openai_sdk() -> None:
    async def body(client, url, router, fakes) -> None:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = await ask_openai(sdk, stream=True)
        with pytest.raises(openai.APIError, match="stream broke off"):
            async for _ in stream:
                pass
        await sdk.close()

    run(lambda: with_mixed(["broken_stream"], 0, body))


@pytest.mark.server
def test_a_stream_cut_mid_way_raises_in_the_anthropic_sdk() -> None:
    async def body(client, url, router, fakes) -> None:
        sdk = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
        stream = await ask_anthropic(sdk, stream=True)
        with pytest.raises(anthropic.APIStatusError, match="stream broke off") as raised:
            async for _ in stream:
                pass
        assert raised.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        await sdk.close()

    run(lambda: with_mixed(["broken_stream"], 0, body))


@pytest.mark.server
def test_refusals_raise_each_sdk_s_own_exception_types() -> None:
    async def body(client, url, router, fakes) -> None:
        oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await ask_openai(oai)
        ant = anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await ask_anthropic(ant)
        assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        good = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.BadRequestError):
            await good.messages.create(model="m", max_tokens=4, messages=[])
        with pytest.raises(anthropic.RequestTooLargeError):
            await ask_anthropic(good, "x" * 4096)
        with pytest.raises(anthropic.NotFoundError):
            await good.post("/v1/nowhere", cast_to=object, body={})
        good_oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            await good_oai.chat.completions.create(model="m", messages=[])
        for engine in router.engines:
            engine.healthy = False
        with pytest.raises(anthropic.InternalServerError) as overloaded:
            await ask_anthropic(good)
        assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        with pytest.raises(openai.InternalServerError):
            await ask_openai(good_oai)
        for sdk in (oai, ant, good, good_oai):
            await sdk.close()

    run(
        lambda: with_mixed(
            [], 1, body, api_keys=frozenset({"k"}), max_body_bytes=2048, health_interval_s=60
        )
    )


def test_each_route_has_its_dialect_and_the_responses_event_parses_in_the_sdk() -> None:
    assert dialect_for("/v1/messages") is ANTHROPIC
    assert dialect_for("/v1/messages/count_tokens") is ANTHROPIC
    assert dialect_for("/v1/responses") is RESPONSES
    assert dialect_for("/v1/responses/resp_1?x=1") is RESPONSES
    assert dialect_for("/v1/chat/completions") is OPENAI
    assert dialect_for("/v1/models") is OPENAI
    assert RESPONSES.body(400, "bad") == OPENAI.body(400, "bad")
    sent = b'event: response.output_text.delta\ndata: {"type": "x", "sequence_number": 41}\n\n'
    event = RESPONSES.stream_event(502, "broke off", sent).decode()
    name, data = event.strip().split("\n")
    assert name == "event: error"
    parsed = ResponseErrorEvent.model_validate(json.loads(data.removeprefix("data: ")))
    assert parsed.sequence_number == 42 and parsed.message == "broke off"


# -- headers to engines -------------------------------------------------------------------


async def with_header_engine(body, key: str = "", **settings) -> None:
    """A router before one engine that answers every generation with the headers it got
    (and remembers those of its /v1/models reads)."""
    seen: dict[str, dict[str, str]] = {}

    async def echo(request: web.Request) -> web.Response:
        seen[request.path] = dict(request.headers)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m"}]})
        return web.json_response({"headers": dict(request.headers)})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", echo)
    app.router.add_post("/v1/messages", echo)
    engine = TestServer(app, host="127.0.0.1")
    await engine.start_server()
    router = Router(
        [Engine(f"http://127.0.0.1:{engine.port}", 1000, api_key=key)],
        RouterSettings(health_interval_s=0.05, **settings),
    )
    try:
        async with router_client(router.app(), True, 30) as (client, url):
            await body(client, url, seen)
    finally:
        await engine.close()


ANTHROPIC_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "mid-conversation-system-2026-04-07",
    "x-claude-code-session-id": "s-1",
}


async def engine_headers(client, url: str, **headers: str) -> dict[str, str]:
    async with client.post(
        url + "/v1/messages", json=MESSAGES, headers={**ANTHROPIC_HEADERS, **headers}
    ) as response:
        assert response.status == 200, await response.text()
        got = (await response.json())["headers"]
    return {name.lower(): value for name, value in got.items()}


@pytest.mark.server
def test_anthropic_and_harness_headers_reach_engines_whatever_the_router_s_key() -> None:
    async def keyed(client, url, seen) -> None:
        got = await engine_headers(client, url, **{"x-api-key": "router-key"})
        for name, value in ANTHROPIC_HEADERS.items():
            assert got[name] == value
        assert "x-api-key" not in got and "authorization" not in got  # the client's key stays

    async def keyed_with_engine_key(client, url, seen) -> None:
        await eventually(lambda: "/v1/models" in seen)
        assert seen["/v1/models"]["Authorization"] == "Bearer engine-key"
        got = await engine_headers(client, url, Authorization="Bearer router-key")
        assert got["authorization"] == "Bearer engine-key"
        assert got["anthropic-beta"] == ANTHROPIC_HEADERS["anthropic-beta"]

    async def open_router(client, url, seen) -> None:
        got = await engine_headers(client, url, **{"x-api-key": "client-key"})
        assert got["x-api-key"] == "client-key"  # no router keys: the engine judges it

    async def own_engine_key(client, url, seen) -> None:
        got = await engine_headers(client, url, **{"x-api-key": "client-key"})
        assert got["authorization"] == "Bearer its-own" and "x-api-key" not in got

    keys = frozenset({"router-key"})
    run(lambda: with_header_engine(keyed, api_keys=keys))
    run(
        lambda: with_header_engine(
            keyed_with_engine_key, api_keys=keys, engine_api_key="engine-key"
        )
    )
    run(lambda: with_header_engine(open_router))
    run(lambda: with_header_engine(own_engine_key, key="its-own", engine_api_key="default"))


def test_engines_take_their_key_from_the_config(tmp_path) -> None:
    from smetric.serve.config import ServeConfig, engines_from, load_config

    config = tmp_path / "router.yaml"
    config.write_text(
        "engines:\n"
        "  - url: http://127.0.0.1:8001\n"
        "    api_key: first\n"
        "  - http://127.0.0.1:8002\n"
        "router:\n"
        "  engine_api_key: shared\n"
    )
    loaded = load_config(ServeConfig, config)
    engines, _ = engines_from(loaded.engines, 100, 16)
    assert [e.api_key for e in engines] == ["first", ""]
    assert loaded.router.engine_api_key == "shared"


# -- count_tokens -------------------------------------------------------------------------


@pytest.mark.server
def test_count_tokens_is_the_engine_s_where_it_serves_it_else_the_router_s() -> None:
    async def through_sdk(client, url, router, fakes) -> None:
        sdk = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
        messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hello"}]
        counted = await sdk.messages.with_raw_response.count_tokens(model="m", messages=messages)
        assert counted.headers["x-smetric-token-count"] == "engine"
        tokens = (await counted.parse()).input_tokens
        assert tokens > 0
        # Without an engine to ask, the router counts with its own tokenizer: the same
        # byte tokenizer and generic template as the mock engine's here.
        for engine in router.engines:
            engine.healthy = False
        counted = await sdk.messages.with_raw_response.count_tokens(model="m", messages=messages)
        assert counted.headers["x-smetric-token-count"] == "router"
        assert (await counted.parse()).input_tokens == tokens
        with pytest.raises(anthropic.BadRequestError):
            await sdk.messages.count_tokens(model="m", messages=[])
        await sdk.close()

    async def not_served(client, url, seen) -> None:
        async with client.post(url + "/v1/messages/count_tokens", json=MESSAGES) as response:
            assert response.status == 200
            assert response.headers["x-smetric-token-count"] == "router"
            assert (await response.json())["input_tokens"] > 0

    run(lambda: with_mixed([], 1, through_sdk, health_interval_s=60))
    run(lambda: with_header_engine(not_served))  # it answers 404 on the route


@pytest.mark.server
def test_an_unknown_stored_response_is_a_counted_refusal_in_the_responses_shape() -> None:
    async def body(client, url, router, fakes) -> None:
        follow_up = {"model": "m", "input": "and then?", "previous_response_id": "resp_nowhere"}
        async with client.post(url + "/v1/responses", json=follow_up) as response:
            assert response.status == 404
            error = (await response.json())["error"]
        assert "resp_nowhere" in error["message"] and error["param"] == "previous_response_id"
        assert refused_count(router, "/v1/responses", 404, "unknown_response") == 1
        async with client.get(url + "/v1/responses/resp_nowhere") as response:
            assert response.status == 404
        assert refused_count(router, "other", 404, "unknown_response") == 1

    run(lambda: with_mixed([], 1, body))


@pytest.mark.server
def test_a_responses_stream_cut_mid_way_ends_with_the_sdk_s_error_event() -> None:
    async def body(client, url, router, fakes) -> None:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = await sdk.responses.create(model="m", input="hi", stream=True)
        events = [event async for event in stream]
        assert isinstance(events[-1], ResponseErrorEvent)
        assert "stream broke off" in events[-1].message
        await sdk.close()

    run(lambda: with_mixed(["broken_stream"], 0, body))


def test_an_engine_error_in_the_other_api_s_shape_reaches_the_client_in_its_own() -> None:
    openai_shaped = json.dumps(
        {"error": {"message": "max_tokens must be at least 1", "type": "BadRequest", "code": 400}}
    ).encode()
    answer = json.loads(ANTHROPIC.engine_error(400, openai_shaped).text or "")
    assert answer == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens must be at least 1"},
    }
    anthropic_shaped = json.dumps(answer).encode()
    assert json.loads(ANTHROPIC.engine_error(400, anthropic_shaped).text or "") == answer
    as_openai = json.loads(OPENAI.engine_error(400, anthropic_shaped).text or "")
    assert as_openai["error"]["message"] == "max_tokens must be at least 1"
    assert json.loads(OPENAI.engine_error(400, openai_shaped).text or "") == json.loads(
        openai_shaped
    )


def test_the_headers_engines_get_follow_one_rule_for_both_front_doors() -> None:
    """``serve``'s request headers and the lower-case ones Envoy hands the picker pass
    alike: the client's key only when the router has no keys of its own."""
    received = {"authorization": "Bearer sk-client", "anthropic-version": "2023-06-01"}
    engines = [Engine("http://127.0.0.1:9", 1000)]
    guarded = Router(engines, RouterSettings(api_keys=frozenset({"sk-router"})))
    passed = guarded.forwarder.upstream_headers(received)
    assert passed["anthropic-version"] == "2023-06-01"
    assert "sk-client" not in str(passed)
    open_router = Router(engines, RouterSettings())
    assert open_router.forwarder.upstream_headers(received)["Authorization"] == "Bearer sk-client"
