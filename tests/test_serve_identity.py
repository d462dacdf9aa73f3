"""Agent identity from harness headers (labels only, nothing stored), the hints a client
sends reaching the engines untouched, and the completion record each request ends in;
over real HTTP on loopback, with an engine that records what it received."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_serve import conversation

from smetric.core.headers import PREDICTED_HIT_HEADER, PREFILL_HEADER
from smetric.serve.app import Router, RouterSettings
from smetric.serve.disagg import Disaggregation
from smetric.serve.engines import Engine
from smetric.serve.forwarding import Completion
from smetric.serve.identity import ANONYMOUS, AgentIdentity, identity_of
from smetric.testing.engines import metric

from conftest import router_client, run

pytestmark = pytest.mark.server

CLAUDE_SUBAGENT = {
    "x-claude-code-session-id": "s-1",
    "x-claude-code-agent-id": "a-7",
    "x-claude-code-parent-agent-id": "a-1",
}
# What engines accept beside the messages: vLLM's priority scheduling, its cache salt,
# the KV connector's parameters, and fields of other vendors' extensions.
HINTS = {
    "priority": -5,
    "cache_salt": "tenant-42",
    "chat_template_kwargs": {"enable_thinking": False},
    "vllm_xargs": {"custom": 1},
    "top_k": 20,
}


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        (CLAUDE_SUBAGENT, {}, AgentIdentity("claude-code", "s-1", "a-7", "a-1")),
        ({"x-claude-code-session-id": "s-1"}, {}, AgentIdentity("claude-code", "s-1")),
        ({"session-id": "c-1"}, {}, AgentIdentity("codex", "c-1")),
        ({"thread-id": "t-1"}, {}, AgentIdentity("codex", "t-1")),
        ({"x-session-id": "o-1"}, {}, AgentIdentity("opencode", "o-1")),
        ({"x-session-affinity": "o-2"}, {}, AgentIdentity("opencode", "o-2")),
        ({"x-dynamo-session-id": "d-1"}, {}, AgentIdentity("dynamo", "d-1")),
        ({}, {"prompt_cache_key": "k-1"}, AgentIdentity("openai", "k-1")),
        ({}, {}, ANONYMOUS),
    ],
)
def test_each_harness_s_headers_name_the_sender(
    headers: dict[str, str], body: dict[str, Any], expected: AgentIdentity
) -> None:
    assert identity_of(headers, body.get("prompt_cache_key")) == expected


def test_roles_and_calls_and_ids_cut_to_a_bound() -> None:
    sub = identity_of(CLAUDE_SUBAGENT)
    assert sub.role == "subagent" and sub.call(0) == "first" and sub.call(2) == "follow_up"
    assert identity_of({"session-id": "c"}).role == "main"
    assert ANONYMOUS.role == "unknown"
    assert len(identity_of({"x-session-id": "x" * 10_000}).session or "") == 128


class RecordingEngine:
    """An OpenAI-compatible engine that keeps every body and header set it received; as a
    vLLM prefill engine it answers ``kv_transfer_params`` for the decode side."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        answer: dict[str, Any] = {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 3}},
        }
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            answer["kv_transfer_params"] = {"remote_engine_id": "p-1", "remote_block_ids": [1]}
        return web.json_response(answer)


async def with_recorders(body: Any, roles: int = 1, first_observer: Any = None) -> Any:
    recorders = [RecordingEngine() for _ in range(roles)]
    servers = [TestServer(r.app(), host="127.0.0.1") for r in recorders]
    for server in servers:
        await server.start_server()
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    disagg = None if roles == 1 else Disaggregation(frozenset(urls[:1]), frozenset(urls[1:]))
    router = Router(
        [Engine(u, 1000) for u in urls],
        RouterSettings(health_interval_s=60),
        disagg=disagg,
    )
    completions: list[Completion] = []
    router.observers.extend([first_observer] if first_observer else [])
    router.observers.append(completions.append)
    try:
        async with router_client(router.app(), True, 30) as (client, url):
            return await body(client, url, recorders, completions)
    finally:
        for server in servers:
            await server.close()


def test_harness_headers_label_decisions_metrics_and_records_and_hints_reach_the_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(client, url, recorders, completions) -> None:
        (engine,) = recorders
        for turns in (0, 1):
            payload = {
                "model": "m",
                "messages": conversation(0, turns),
                **HINTS,
                "kv_transfer_params": {"remote_host": "203.0.113.9", "remote_port": 1},
            }
            async with client.post(
                url + "/v1/chat/completions", json=payload, headers=CLAUDE_SUBAGENT
            ) as response:
                assert response.status == 200, await response.text()
        for received in engine.bodies:  # each hint as the client sent it
            assert {k: received[k] for k in HINTS} == HINTS
            assert "kv_transfer_params" not in received  # the router's alone
        assert engine.headers[0]["x-claude-code-parent-agent-id"] == "a-1"  # passed on too
        first, follow_up = completions
        for record in completions:
            assert record.identity == AgentIdentity("claude-code", "s-1", "a-7", "a-1")
            assert record.outcome == "completed" and record.status == 200
            assert record.cached_tokens == 3 and record.ttft_s is not None
            assert record.engine is not None and record.routed is not None
        assert (first.facts.turn, follow_up.facts.turn) == (0, 1)
        async with client.get(url + "/metrics") as response:
            text = await response.text()
        for call in ("first", "follow_up"):
            labels = {"harness": "claude-code", "role": "subagent", "call": call}
            assert metric(text, "smetric_agent_requests_total", **labels) == 1
        assert "s-1" not in text  # ids never become label values

    with caplog.at_level(logging.INFO, logger="smetric.serve"):
        run(lambda: with_recorders(body))
    routes = [json.loads(r.message) for r in caplog.records if '"event": "route"' in r.message]
    assert [(r["session"], r["parent_agent"], r["agent_call"]) for r in routes] == [
        ("s-1", "a-1", "first"),
        ("s-1", "a-1", "follow_up"),
    ]


def test_hints_reach_both_legs_of_a_disaggregated_request_with_the_predicted_hit() -> None:
    async def body(client, url, recorders, completions) -> None:
        prefill, decode = recorders
        client_params = {"lmcache.tag": "x", "remote_host": "203.0.113.9"}
        payload = {
            "model": "m",
            "messages": conversation(1, 0),
            "stream": False,
            **HINTS,
            "kv_transfer_params": client_params,
        }
        async with client.post(url + "/v1/chat/completions", json=payload) as response:
            assert response.status == 200, await response.text()
            assert int(response.headers[PREDICTED_HIT_HEADER]) >= 0
            assert response.headers[PREFILL_HEADER]
        (leg1,), (leg2,) = prefill.bodies, decode.bodies
        assert {k: leg1[k] for k in HINTS} == HINTS == {k: leg2[k] for k in HINTS}
        # The client's own transfer keys never reach an engine: the prefill leg carries the
        # router's alone...
        assert leg1["kv_transfer_params"]["do_remote_decode"] is True
        assert leg1["kv_transfer_params"].get("remote_host") != "203.0.113.9"
        assert "lmcache.tag" not in leg1["kv_transfer_params"]
        # ...and the decode leg gets what the prefill engine handed over.
        assert leg2["kv_transfer_params"] == {"remote_engine_id": "p-1", "remote_block_ids": [1]}
        (record,) = completions
        assert record.prefill_engine and record.engine and record.prefill_engine != record.engine
        assert record.prefill_cached_tokens == 3

    run(lambda: with_recorders(body, roles=2))


def test_an_observer_that_fails_costs_the_client_nothing() -> None:
    async def body(client, url, recorders, completions) -> None:
        payload = {"model": "m", "messages": conversation(2, 0)}
        async with client.post(url + "/v1/chat/completions", json=payload) as response:
            assert response.status == 200
        assert len(completions) == 1  # the observer after the failing one still ran

    def broken(_: Completion) -> None:
        raise RuntimeError("observer bug")

    run(lambda: with_recorders(body, first_observer=broken))
