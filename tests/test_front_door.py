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
from openai.types.responses import ResponseErrorEvent
from test_serve import CHAT, run
from test_serve_faults import with_mixed

from smetric.serve.errors import ANTHROPIC, OPENAI, RESPONSES, dialect_for
from smetric.serve.refusals import Refusal, RefusalLog

MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}


def refused_count(router, route: str, status: int, reason: str) -> float:
    value = router.metrics.registry.get_sample_value(
        "smetric_refused_requests_total", {"route": route, "status": str(status), "reason": reason}
    )
    return value or 0.0


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


def test_a_stream_cut_mid_way_raises_in_the_openai_sdk() -> None:
    async def body(client, url, router, fakes) -> None:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = await sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError, match="stream broke off"):
            async for _ in stream:
                pass
        await sdk.close()

    run(lambda: with_mixed(["broken_stream"], 0, body))


def test_a_stream_cut_mid_way_raises_in_the_anthropic_sdk() -> None:
    async def body(client, url, router, fakes) -> None:
        sdk = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
        stream = await sdk.messages.create(**MESSAGES, stream=True)
        with pytest.raises(anthropic.APIStatusError, match="stream broke off") as raised:
            async for _ in stream:
                pass
        assert raised.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        await sdk.close()

    run(lambda: with_mixed(["broken_stream"], 0, body))


def test_refusals_raise_each_sdk_s_own_exception_types() -> None:
    async def body(client, url, router, fakes) -> None:
        oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await oai.chat.completions.create(**CHAT)
        ant = anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await ant.messages.create(**MESSAGES)
        assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        good = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.BadRequestError):
            await good.messages.create(model="m", max_tokens=4, messages=[])
        with pytest.raises(anthropic.RequestTooLargeError):
            await good.messages.create(
                model="m", max_tokens=4, messages=[{"role": "user", "content": "x" * 4096}]
            )
        with pytest.raises(anthropic.NotFoundError):
            await good.post("/v1/nowhere", cast_to=object, body={})
        good_oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            await good_oai.chat.completions.create(model="m", messages=[])
        for engine in router.engines:
            engine.healthy = False
        with pytest.raises(anthropic.InternalServerError) as overloaded:
            await good.messages.create(**MESSAGES)
        assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        with pytest.raises(openai.InternalServerError):
            await good_oai.chat.completions.create(**CHAT)
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
