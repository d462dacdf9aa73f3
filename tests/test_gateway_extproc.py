"""The picker's ext_proc stream handling, message by message (real protobuf messages, the
router's real routing core; no network): what Envoy is told, what it gets back, and the
load each exchange holds until it ends."""

from __future__ import annotations

import gzip
import json
import re
import textwrap
from typing import Any

import yaml
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from smetric.gateway import protocol
from smetric.gateway.extproc import Exchange
from smetric.gateway.picker import Picker, endpoint_of
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine

from conftest import run

URLS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://[::1]:8003"]


def picker(policy: str = "smetric", max_inflight: int = 0) -> Picker:
    router = Router([Engine(u, 1000) for u in URLS], RouterSettings(policy=policy))
    return Picker(router, max_inflight=max_inflight)


def headers(
    values: dict[str, str], end: bool = False, subset: Any = None
) -> ext_proc.ProcessingRequest:
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            ),
            end_of_stream=end,
        )
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({protocol.SUBSET: subset})
        message.metadata_context.filter_metadata[protocol.SUBSET_NAMESPACE].CopyFrom(hint)
    return message


def body(piece: bytes, end: bool, phase: str = "request") -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        **{f"{phase}_body": ext_proc.HttpBody(body=piece, end_of_stream=end)}
    )


def response_headers(status: int, served: str | None = None) -> ext_proc.ProcessingRequest:
    values = {":status": str(status), "content-type": "text/event-stream"}
    if served is not None:
        values[protocol.SERVED] = served
    message = headers(values)
    return ext_proc.ProcessingRequest(response_headers=message.request_headers)


POST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}


def chat_body(turns: int = 0) -> bytes:
    messages = [{"role": "user", "content": "fix the failing test " * 40}]
    for turn in range(turns):
        messages += [
            {"role": "assistant", "content": f"ran step {turn} " * 20},
            {"role": "user", "content": f"output {turn} " * 30},
        ]
    return json.dumps({"model": "m", "messages": messages, "stream": True}).encode()


def set_headers(reply: ext_proc.ProcessingResponse, phase: str) -> dict[str, str]:
    mutation = getattr(reply, f"{phase}_headers").response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def echoed(replies: list[ext_proc.ProcessingResponse], phase: str = "request") -> bytes:
    return b"".join(
        getattr(r, f"{phase}_body").response.body_mutation.streamed_response.body
        for r in replies
        if r.WhichOneof("response") == f"{phase}_body"
    )


async def send_request(
    exchange: Exchange, raw: bytes, pieces: int = 3
) -> list[ext_proc.ProcessingResponse]:
    replies = await exchange.on(headers(POST))
    step = len(raw) // pieces + 1
    chunks = [raw[i : i + step] for i in range(0, len(raw), step)]
    for i, chunk in enumerate(chunks):
        got = await exchange.on(body(chunk, end=i == len(chunks) - 1))
        if i < len(chunks) - 1:
            assert got == []  # held until the body is whole: the pick needs it
        replies += got
    return replies


def test_the_pick_is_named_in_header_and_metadata_and_the_body_comes_back_whole() -> None:
    async def go() -> None:
        exchange = Exchange(picker())
        raw = chat_body()
        replies = await send_request(exchange, raw)
        first = replies[0]
        assert first.WhichOneof("response") == "request_headers"
        endpoint = set_headers(first, "request")[protocol.DESTINATION]
        metadata = first.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value
        assert metadata.fields[protocol.DESTINATION].string_value == endpoint
        assert endpoint in {"127.0.0.1:8001", "127.0.0.1:8002", "[::1]:8003"}
        assert echoed(replies) == raw
        ends = [
            r.request_body.response.body_mutation.streamed_response.end_of_stream
            for r in replies[1:]
        ]
        assert ends == [False, False, True]
        pick = exchange.pick
        assert pick is not None and pick.facts is not None
        engine = pick.engine
        assert (engine.inflight, engine.inflight_tokens) == (1, pick.facts.prompt_tokens)
        # The response streams through piece by piece, its usage read on the way.
        await exchange.on(response_headers(200))
        usage = {"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 32}}}
        for piece, end in (
            (b'data: {"choices": []}\n\n', False),
            (f"data: {json.dumps(usage)}\n\n".encode(), True),
        ):
            reply = await exchange.on(body(piece, end, phase="response"))
            assert echoed(reply, "response") == piece
        assert (engine.inflight, engine.inflight_tokens, engine.unprefilled) == (0, 0, 0)
        reported = exchange.picker.router.metrics.reported.labels(engine.url)._value.get()
        assert reported == 32

    run(go)


def test_follow_ups_stick_and_the_served_engine_is_charged() -> None:
    async def go() -> None:
        chooser = picker()
        first = Exchange(chooser)
        await send_request(first, chat_body(0))
        assert first.pick is not None
        home = first.pick.engine
        await first.on(response_headers(200))
        await first.on(body(b"{}", True, phase="response"))
        follow = Exchange(chooser)
        await send_request(follow, chat_body(1))
        assert follow.pick is not None
        assert follow.pick.engine is home  # sticky: the prefix is cached there
        assert follow.pick.predicted > 0
        # The decision is recorded as serve records it: price learning reads the local hit.
        routed = follow.pick.completion.routed if follow.pick.completion else None
        assert routed is not None and routed.predicted_local_tokens == follow.pick.predicted
        # Envoy sent it elsewhere (a retry, a fallback): the load moves with it.
        other = next(e for e in chooser.router.engines if e is not home)
        reply = await follow.on(response_headers(200, served=endpoint_of(other.url)))
        assert set_headers(reply[0], "response")["x-smetric-engine"] == other.url
        assert (home.inflight, other.inflight) == (0, 1)
        follow.close(complete=False)  # the stream broke before the response ended
        assert (home.inflight, other.inflight, other.unprefilled, other.inflight_tokens) == (
            0,
            0,
            0,
            0,
        )
        assert chooser.router.metrics.retries._value.get() == 1

    run(go)


def test_subset_hint_limits_the_choice_and_an_empty_one_is_a_503() -> None:
    async def go() -> None:
        chooser = picker(policy="round_robin")
        for _ in range(4):
            exchange = Exchange(chooser)
            await exchange.on(headers(POST, subset=["[::1]:8003"]))
            replies = await exchange.on(body(chat_body(), True))
            assert set_headers(replies[0], "request")[protocol.DESTINATION] == "[::1]:8003"
            exchange.close(complete=False)
        exchange = Exchange(chooser)
        replies = await exchange.on(headers(POST, subset="10.0.0.9:80,10.0.0.8:80"))
        replies += await exchange.on(body(chat_body(), True))
        assert replies[-1].immediate_response.status.code == 503
        error = json.loads(replies[-1].immediate_response.body)["error"]
        assert "10.0.0.8:80, 10.0.0.9:80" in error["message"]
        assert exchange.refused

    run(go)


def test_refusals_no_engine_shed_load_bad_body() -> None:
    async def go() -> None:
        chooser = picker(max_inflight=1)
        held = []
        for _ in URLS:  # one request in flight everywhere
            exchange = Exchange(chooser)
            await send_request(exchange, chat_body())
            held.append(exchange)
        shed = Exchange(chooser)
        assert (await send_request(shed, chat_body()))[-1].immediate_response.status.code == 429
        for exchange in held:
            exchange.close(complete=False)
        bad = Exchange(chooser)
        reply = await send_request(bad, b'{"messages": [')
        assert reply[-1].immediate_response.status.code == 400
        assert json.loads(reply[-1].immediate_response.body)["error"]["type"]
        for engine in chooser.router.engines:
            engine.healthy = False
        down = Exchange(chooser)
        reply = await send_request(down, chat_body())
        assert reply[-1].immediate_response.status.code == 503
        assert all(e.inflight == 0 for e in chooser.router.engines)

    run(go)


def test_a_request_without_a_body_is_picked_at_its_headers() -> None:
    async def go() -> None:
        exchange = Exchange(picker())
        replies = await exchange.on(headers({":method": "GET", ":path": "/v1/models"}, end=True))
        assert len(replies) == 1 and protocol.DESTINATION in set_headers(replies[0], "request")
        await exchange.on(
            ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(end_of_stream=True))
        )
        assert all(e.inflight == 0 for e in exchange.picker.router.engines)

    run(go)


def test_the_docs_ship_the_envoy_configuration_the_tests_run() -> None:
    """The shipped file, whole, and the ``ORIGINAL_DST`` alternative the tests also run."""
    from smetric.testing.gateway import GATEWAY_CONFIG, ORIGINAL_DST_CLUSTER

    page = (GATEWAY_CONFIG.parents[2] / "docs" / "guides" / "gateway.md").read_text()
    assert "```yaml\n" + GATEWAY_CONFIG.read_text() + "```" in page
    blocks = re.findall(r"\n( *)```yaml\n(.*?)\n\1```", page, re.DOTALL)
    alternative = next(text for _, text in blocks if "ORIGINAL_DST" in text)
    assert yaml.safe_load(textwrap.dedent(alternative)) == [ORIGINAL_DST_CLUSTER]


def test_the_served_endpoint_is_read_from_the_protocol_metadata_before_the_header() -> None:
    metadata = base_pb2.Metadata()
    served = struct_pb2.Struct()
    served.update({protocol.SERVED: "10.0.0.7:8000"})
    metadata.filter_metadata[protocol.LB_NAMESPACE].CopyFrom(served)
    assert protocol.served_endpoint(metadata, {protocol.SERVED: "10.0.0.8:8000"}) == "10.0.0.7:8000"
    assert protocol.served_endpoint(base_pb2.Metadata(), {protocol.SERVED: "10.0.0.8:8000"}) == (
        "10.0.0.8:8000"
    )
    assert protocol.served_endpoint(base_pb2.Metadata(), {}) is None


def test_the_picker_counts_its_refusals_and_answers_in_the_route_s_shape() -> None:
    async def go() -> None:
        chooser = picker()
        exchange = Exchange(chooser)
        await exchange.on(headers({**POST, ":path": "/v1/messages"}))
        reply = await exchange.on(body(b"[1]", True))
        answer = json.loads(reply[-1].immediate_response.body)
        assert reply[-1].immediate_response.status.code == 400
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        big = Exchange(chooser)
        await big.on(headers(POST))
        limit = chooser.router.settings.max_body_bytes
        reply = await big.on(body(b" " * (limit + 1), False))
        assert reply[-1].immediate_response.status.code == 413
        message = json.loads(reply[-1].immediate_response.body)["error"]["message"]
        assert f"--max-body-bytes ({limit} bytes)" in message
        registry = chooser.router.metrics.registry
        for route, status, reason in [
            ("/v1/messages", "400", "not_an_object"),
            ("/v1/chat/completions", "413", "body_too_large"),
        ]:
            labels = {"route": route, "status": status, "reason": reason}
            assert registry.get_sample_value("smetric_refused_requests_total", labels) == 1

    run(go)


def test_an_engine_that_requires_a_key_gets_its_own_through_the_picker() -> None:
    async def go() -> None:
        router = Router(
            [Engine(URLS[0], 1000, api_key="engine-key")], RouterSettings(api_keys=frozenset({"k"}))
        )
        exchange = Exchange(Picker(router))
        await exchange.on(headers({**POST, "authorization": "Bearer k", "x-api-key": "k"}))
        replies = await exchange.on(body(chat_body(), True))
        assert set_headers(replies[0], "request")["authorization"] == "Bearer engine-key"
        mutation = replies[0].request_headers.response.header_mutation
        assert "x-api-key" in mutation.remove_headers  # the client's key stays here
        exchange.close(complete=False)

    run(go)


def test_a_token_count_the_engine_does_not_serve_is_the_router_s() -> None:
    count = {":method": "POST", ":path": "/v1/messages/count_tokens"}
    request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})

    async def go() -> None:
        chooser = picker()
        counts = {}
        for status in (200, 404):
            exchange = Exchange(chooser)
            await exchange.on(headers(count))
            await exchange.on(body(request.encode(), True))
            replies = await exchange.on(response_headers(status))
            if status == 200:  # the engine counted: its answer passes, tagged
                assert set_headers(replies[0], "response")["x-smetric-token-count"] == "engine"
                assert not exchange.answered
                exchange.close(complete=True)
            else:
                answer = replies[-1].immediate_response
                assert answer.status.code == 200 and exchange.answered
                tagged = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
                assert tagged["x-smetric-token-count"] == b"router"
                counts[status] = json.loads(answer.body)["input_tokens"]
        assert counts[404] > 0
        assert all(e.inflight == 0 for e in chooser.router.engines)

    run(go)


def whole(values: dict[str, str]) -> ext_proc.ProcessingRequest:
    """Request headers as the shipped configuration sends them: the body to come whole, the
    response's pieces to be read and not sent back."""
    message = headers(values)
    message.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    message.protocol_config.response_body_mode = ProcessingMode.STREAMED
    return message


def test_a_whole_body_is_answered_with_the_pick_and_no_copy() -> None:
    async def go() -> None:
        exchange = Exchange(picker())
        (reply,) = await exchange.on(whole(POST))
        # The headers go on untouched: Envoy then sends the body, and holds the headers
        # until the body's answer.
        untouched = reply.request_headers.response
        assert not untouched.header_mutation.set_headers and not untouched.clear_route_cache
        assert exchange.pick is None
        (reply,) = await exchange.on(body(chat_body(), True))
        common = reply.request_body.response
        assert not common.HasField("body_mutation")  # Envoy forwards its own copy
        assert common.clear_route_cache
        endpoint = {
            h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers
        }[protocol.DESTINATION]
        metadata = reply.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value
        assert metadata.fields[protocol.DESTINATION].string_value == endpoint
        assert exchange.picker.router.buffered.used == 0  # the body is not the picker's now
        pick = exchange.pick
        assert pick is not None and pick.endpoint == endpoint
        await exchange.on(response_headers(200))
        usage = {"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 16}}}
        for piece, end in (
            (b'data: {"choices": []}\n\n', False),
            (f"data: {json.dumps(usage)}\n\n".encode(), True),
        ):
            (reply,) = await exchange.on(body(piece, end, phase="response"))
            assert not reply.response_body.response.HasField("body_mutation")
        engine = pick.engine
        assert (engine.inflight, engine.inflight_tokens) == (0, 0)
        assert exchange.picker.router.metrics.reported.labels(engine.url)._value.get() == 16

    run(go)


def test_a_whole_body_rewritten_goes_in_the_answer_with_its_length() -> None:
    async def go() -> None:
        exchange = Exchange(picker())
        # A client's kv_transfer_params never reach an engine: the body is rewritten.
        steered = {**json.loads(chat_body()), "kv_transfer_params": {"remote_host": "10.9.9.9"}}
        await exchange.on(whole({**POST, "content-encoding": "gzip"}))
        (reply,) = await exchange.on(body(gzip.compress(json.dumps(steered).encode()), True))
        common = reply.request_body.response
        rewritten = json.loads(common.body_mutation.body)  # inflated, as plain JSON
        assert "kv_transfer_params" not in rewritten and rewritten["messages"]
        named = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
        assert named["content-length"] == str(len(common.body_mutation.body)).encode()
        assert list(common.header_mutation.remove_headers) == ["content-encoding"]
        exchange.close(complete=False)

    run(go)


def test_a_whole_body_the_engines_should_not_see_is_refused() -> None:
    async def go() -> None:
        exchange = Exchange(picker())
        await exchange.on(whole({**POST, ":path": "/v1/messages"}))
        (reply,) = await exchange.on(body(b"[1]", True))
        assert reply.immediate_response.status.code == 400 and exchange.answered

    run(go)


def test_the_shipped_envoy_holds_bodies_up_to_the_router_s_limit() -> None:
    """Envoy's 413 and the picker's (and ``serve``'s) start at the same size."""
    from smetric.testing.gateway import GATEWAY_CONFIG

    config = yaml.safe_load(GATEWAY_CONFIG.read_text())
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (route,) = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert route["request_body_buffer_limit"] == RouterSettings().max_body_bytes
