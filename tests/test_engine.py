"""The mock engine over real HTTP on loopback: shapes, cache hits, metrics, eviction, batching."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from smetric.engine import EngineConfig, create_app
from smetric.engine.scheduler import filler_token

pytestmark = pytest.mark.server

BS = 16
FAST = EngineConfig(speed=0.001)
SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 6}

Scenario = Callable[[TestClient], Awaitable[None]]


def serve(config: EngineConfig, scenario: Scenario) -> None:
    async def main() -> None:
        async with TestClient(TestServer(create_app(config))) as client:
            await scenario(client)

    asyncio.run(main())


def chat(messages: list[dict[str, Any]], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


async def post(client: TestClient, path: str, body: object, status: int = 200) -> dict[str, Any]:
    response = await client.post(path, json=body)
    assert response.status == status, await response.text()
    return await response.json()


async def stream(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's JSON chunks; checks the SSE framing and the closing ``[DONE]``."""
    response = await client.post(path, json={**body, "stream": True})
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = (await response.text()).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: ") for event in events[:-1])
    return [json.loads(event.removeprefix("data: ")) for event in events[:-2]]


async def metrics(client: TestClient) -> dict[str, float]:
    response = await client.get("/metrics")
    assert response.status == 200
    families = text_string_to_metric_families(await response.text())
    return {s.name: s.value for family in families for s in family.samples}


async def prompt_tokens(client: TestClient, body: dict[str, Any]) -> list[int]:
    return (await post(client, "/tokenize", body))["tokens"]


def test_non_streaming_shapes_and_exact_token_counts() -> None:
    async def scenario(client: TestClient) -> None:
        reply = await post(
            client, "/v1/chat/completions", chat([{"role": "user", "content": "hi"}], 7)
        )
        assert reply["object"] == "chat.completion"
        (choice,) = reply["choices"]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == "".join(filler_token(i) for i in range(7))
        assert choice["finish_reason"] == "length"
        usage = reply["usage"]
        assert usage["completion_tokens"] == 7
        assert usage["total_tokens"] == usage["prompt_tokens"] + 7
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}

        reply = await post(client, "/v1/completions", {"prompt": "hello there", "max_tokens": 5})
        assert reply["object"] == "text_completion"
        assert len(reply["choices"][0]["text"].split()) == 5
        assert reply["usage"]["prompt_tokens"] == len("hello there")

        # Filler has no end of its own: with no bound set, the reply ends by itself.
        reply = await post(client, "/v1/completions", {"prompt": "no max_tokens"})
        assert reply["usage"]["completion_tokens"] == FAST.default_max_tokens
        assert reply["choices"][0]["finish_reason"] == "stop"

    serve(FAST, scenario)


def test_streaming_shapes_and_exact_token_counts() -> None:
    async def scenario(client: TestClient) -> None:
        body = chat([{"role": "user", "content": "hi"}], 9, stream_options={"include_usage": True})
        chunks = await stream(client, "/v1/chat/completions", body)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        tokens = chunks[1:-1]
        assert [c["choices"][0]["delta"]["content"] for c in tokens] == [
            filler_token(i) for i in range(9)
        ]
        assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 8 + ["length"]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 9

        chunks = await stream(client, "/v1/completions", {"prompt": "abc", "max_tokens": 4})
        assert [c["choices"][0]["text"] for c in chunks] == [filler_token(i) for i in range(4)]
        assert "usage" not in chunks[-1]

    serve(FAST, scenario)


def test_a_stream_s_headers_come_at_once_and_its_body_with_the_first_token() -> None:
    """As vLLM streams: the headers as soon as the request is taken, then nothing until the
    prefill is done; the chat role chunk and the Messages API's message_start come with the
    first token, not before it."""
    long = [{"role": "user", "content": "x" * 6000}]  # three 2,048-token prefill steps

    async def scenario(client: TestClient) -> None:
        for path, body in (
            ("/v1/chat/completions", chat(long, 2, stream=True)),
            ("/v1/messages", {"model": "m", "messages": long, "max_tokens": 2, "stream": True}),
        ):
            before = await metrics(client)
            async with client.post(path, json=body) as response:
                assert response.status == 200
                taken = await metrics(client)
                assert taken["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"]
                first = await response.content.readline()
                prefilled = await metrics(client)
                assert prefilled["vllm:prompt_tokens_total"] > taken["vllm:prompt_tokens_total"]
                rest = await response.content.read()
            if path == "/v1/messages":
                assert first == b"event: message_start\n"
                continue
            opening = json.loads(first.removeprefix(b"data: "))
            assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            token = json.loads(rest.split(b"\n\n")[0].strip().removeprefix(b"data: "))
            assert token["choices"][0]["delta"] == {"content": filler_token(0)}

    serve(EngineConfig(speed=1.0), scenario)


def test_follow_up_hits_previous_prompt_and_metrics_agree() -> None:
    async def scenario(client: TestClient) -> None:
        first = [SYSTEM, {"role": "user", "content": "List the files in src/."}]
        one = await post(client, "/v1/chat/completions", chat(first))
        p1 = one["usage"]["prompt_tokens"]
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        answer = {"role": "assistant", "content": one["choices"][0]["message"]["content"]}
        second = [*first, answer, {"role": "user", "content": "Now open main.py."}]
        two = await post(client, "/v1/chat/completions", chat(second))
        assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == p1 // BS * BS

        # Another conversation shares only the system prompt's full blocks.
        other = [SYSTEM, {"role": "user", "content": "Write a haiku."}]
        shared = 0
        for a, b in zip(
            await prompt_tokens(client, {"messages": first}),
            await prompt_tokens(client, {"messages": other}),
            strict=False,
        ):
            if a != b:
                break
            shared += 1
        assert shared >= BS  # the test means something only if some blocks are shared
        three = await post(client, "/v1/chat/completions", chat(other))
        assert three["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // BS * BS

        replies = [one, two, three]
        seen = await metrics(client)
        cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)
        prompts = sum(r["usage"]["prompt_tokens"] for r in replies)
        assert seen["vllm:prefix_cache_hits_total"] == cached
        assert seen["vllm:prefix_cache_queries_total"] == prompts
        assert seen["vllm:prompt_tokens_total"] == prompts
        assert seen["vllm:generation_tokens_total"] == 3 * 8
        assert seen["vllm:num_requests_running"] == 0
        assert seen["vllm:num_requests_waiting"] == 0
        assert seen["vllm:kv_cache_usage_perc"] == 0
        assert seen["vllm:cache_config_info"] == 1
        text = await (await client.get("/metrics")).text()
        assert 'block_size="16"' in text and 'num_gpu_blocks="4096"' in text

    serve(FAST, scenario)


def test_tokenize_counts_match_usage() -> None:
    async def scenario(client: TestClient) -> None:
        messages = [SYSTEM, {"role": "user", "content": "héllo"}]
        counted = await post(client, "/tokenize", {"model": "m", "messages": messages})
        reply = await post(client, "/v1/chat/completions", chat(messages))
        assert counted["count"] == len(counted["tokens"]) == reply["usage"]["prompt_tokens"]
        assert counted["max_model_len"] == FAST.context_len

        counted = await post(client, "/tokenize", {"model": "m", "prompt": "plain text"})
        reply = await post(client, "/v1/completions", {"prompt": "plain text"})
        assert counted["count"] == reply["usage"]["prompt_tokens"] == len("plain text")

    serve(FAST, scenario)


def test_lru_eviction_forgets_an_old_conversation() -> None:
    async def hit(client: TestClient, prompt: str) -> int:
        reply = await post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def scenario(client: TestClient) -> None:
        old = "o" * 300
        assert await hit(client, old) == 0
        assert await hit(client, old) == 299 // BS * BS
        for letter in "abcdefgh":
            assert await hit(client, letter * 300) == 0
        assert await hit(client, old) == 0

    serve(EngineConfig(speed=0.001, kv_blocks=64), scenario)


def test_malformed_bodies_get_openai_400s() -> None:
    cases: list[tuple[str, object]] = [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b"\xff\xfe"),
        ("/v1/chat/completions", {"model": "m"}),
        ("/v1/chat/completions", {"messages": "hi"}),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
        ("/v1/chat/completions", [1, 2]),
        ("/v1/chat/completions", chat([{"role": "user", "content": "x"}], max_tokens=0)),
        ("/v1/chat/completions", {**chat([{"role": "user", "content": "x"}]), "stream": "yes"}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 10**6}),
        ("/tokenize", {"messages": 3}),
        ("/tokenize", b"[" * 100_000),
    ]

    async def scenario(client: TestClient) -> None:
        for path, body in cases:
            if isinstance(body, bytes):
                response = await client.post(path, data=body)
            else:
                response = await client.post(path, json=body)
            assert response.status == 400, (path, body)
            error = (await response.json())["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == 400
            assert isinstance(error["message"], str) and error["message"]
        assert (await client.get("/health")).status == 200  # still serving

    serve(FAST, scenario)


def test_models_and_health() -> None:
    async def scenario(client: TestClient) -> None:
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["demo-model"]
        assert (await client.get("/health")).status == 200

    serve(EngineConfig(speed=0.001, served_model_name="demo-model"), scenario)


def test_concurrent_streams_are_batched() -> None:
    order: list[str] = []

    async def follow(client: TestClient, name: str) -> None:
        body = {"prompt": f"request {name}", "max_tokens": 30, "stream": True}
        response = await client.post("/v1/completions", json=body)
        async for line in response.content:
            if line.startswith(b"data: {"):
                order.append(name)

    async def scenario(client: TestClient) -> None:
        await asyncio.gather(follow(client, "a"), follow(client, "b"))

    # Decode steps of about 2 ms: slow enough that each token reaches its client in turn.
    serve(EngineConfig(speed=0.5), scenario)
    assert order.count("a") == order.count("b") == 30
    assert order.index("b") < len(order) - 1 - order[::-1].index("a")
    assert order.index("a") < len(order) - 1 - order[::-1].index("b")


def test_requests_wait_for_kv_and_disconnects_free_it() -> None:
    # 40 blocks hold one 300-token prompt plus 200 output tokens (32 blocks), not two.
    config = EngineConfig(speed=0.2, kv_blocks=40)

    async def scenario(client: TestClient) -> None:
        body = {"prompt": "x" * 300, "max_tokens": 200, "stream": True}
        first = await client.post("/v1/completions", json=body)
        await first.content.readline()
        second = asyncio.create_task(post(client, "/v1/completions", {**body, "stream": False}))
        for _ in range(200):
            seen = await metrics(client)
            if seen["vllm:num_requests_waiting"] == 1:
                break
            await asyncio.sleep(0.005)
        assert seen["vllm:num_requests_running"] == 1
        assert seen["vllm:num_requests_waiting"] == 1
        first.close()  # the client goes away: its blocks go back, the waiting one runs
        reply = await second
        assert reply["usage"]["completion_tokens"] == 200
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 299 // BS * BS
        seen = await metrics(client)
        assert seen["vllm:num_requests_running"] == seen["vllm:num_requests_waiting"] == 0
        assert seen["vllm:kv_cache_usage_perc"] == 0
        assert seen["vllm:generation_tokens_total"] < 400

    serve(config, scenario)


def test_model_info_and_server_info_answer_sglang_router_probes() -> None:
    async def scenario(client: TestClient) -> None:
        info = await (await client.get("/model_info")).json()
        assert info == {"model_path": "demo-model", "is_generation": True}
        server = await client.get("/server_info")
        assert server.status == 200
        config = await server.json()
        assert config["served_model_name"] == "demo-model"
        assert config["block_size"] == 16
        assert config["max_model_len"] > 0

    serve(EngineConfig(speed=0.001, served_model_name="demo-model"), scenario)
