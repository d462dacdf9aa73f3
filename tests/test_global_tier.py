"""The router's view of the global tier on loopback (real HTTP, real ZMQ, mock engines):
from engines' offload events, from its record of served prompts, and the decisions
``smetric_cost`` makes on it, checked against the policy run on the same view."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from test_router_view import HeldEngine, with_held_engines
from test_router_view import chat as held_chat
from test_router_view import conversation as held_conversation
from test_serve import (
    ANY_PORT,
    chat,
    conversation,
    events_engine_of,
    eventually,
    run,
    with_cluster,
    with_router,
)

from smetric.core.blocks import reusable_hit_tokens
from smetric.core.policies import ClusterView, RoutingRequest, make_policy
from smetric.core.policies.smetric_cost import SMetricCost
from smetric.engine import EngineConfig, create_app
from smetric.engine.server import KV_EVENTS
from smetric.serve.app import Router
from smetric.serve.config import ServeConfig, engines_from, load_config, router_settings
from smetric.serve.engines import Engine
from smetric.serve.global_tier import ServedPrompts, global_tier_from
from smetric.serve.workers import PeerViews

from conftest import until_heard

pytestmark = pytest.mark.server

BS = 16


def routes(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The router's decision log lines, in order."""
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "smetric.serve"]
    return [line for line in lines if line.get("event") == "route"]


async def blocks_of(router: Router, session: int, turn: int) -> np.ndarray:
    body = {"messages": conversation(session, turn), "max_tokens": 4}
    return (await router.analyzer.analyze(body, "chat")).blocks


def test_the_global_hit_comes_from_blocks_engines_report_on_a_cpu_medium(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine that offloads (``--cpu-offload-blocks``) announces its CPU blocks; once its
    GPU evicted a session, the router sees the session's prefix in the global tier only,
    and the engine indeed serves exactly that much from its CPU store."""
    # The engine binds both sockets on ports the OS picks; the router connects to them.
    config = EngineConfig(
        speed=0.0001,
        kv_blocks=120,  # a few sessions' prompts: later sessions evict earlier ones
        cpu_offload_blocks=1000,
        kv_events_endpoint=ANY_PORT,
        kv_events_bind=True,
        kv_events_replay_endpoint=ANY_PORT,
    )
    caplog.set_level(logging.INFO, logger="smetric.serve")

    async def scenario() -> None:
        engine_server = TestServer(create_app(config), host="127.0.0.1")
        await engine_server.start_server()
        publisher = engine_server.app[KV_EVENTS]
        yaml_file = tmp_path / "engines.yaml"
        yaml_file.write_text(
            "router:\n  global_tier: events\nengines:\n" + events_engine_of(engine_server, "kv")
        )
        loaded = load_config(ServeConfig, yaml_file)
        engines, subscribers = engines_from(loaded.engines, 1000, BS)
        settings = router_settings(loaded.router)
        settings.health_interval_s = 60
        router = Router(engines, settings, subscribers=subscribers)
        subscriber = subscribers[engines[0].url]

        async def settled() -> None:
            await eventually(lambda: subscriber.tracker.last == publisher.seq - 1)

        async def body(client: aiohttp.ClientSession, url: str) -> None:
            async def warm_up(attempt: int) -> None:
                await chat(client, url, [{"role": "user", "content": f"warm-up {attempt} " * 9}])

            await until_heard(warm_up, lambda: subscriber.counters.batches > 0)
            for session in range(6):  # sessions 1-5 push session 0 out of the GPU
                await chat(client, url, conversation(session, 0))
                await settled()
            first = await blocks_of(router, 0, 0)
            view = engines[0].events
            assert view is not None  # the engine publishes KV events
            assert view.match(first) < len(first)
            assert view.match_offloaded(first) == len(first)
            caplog.clear()
            payload = {"model": "m", "messages": conversation(0, 1), "max_tokens": 4}
            async with client.post(url + "/v1/chat/completions", json=payload) as response:
                data = await response.json()
                predicted = int(response.headers["x-smetric-predicted-hit-tokens"])
            (decision,) = routes(caplog)
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert decision["global_hit_tokens"] == cached == len(first) * BS
            # The GPU held less; the prediction (and the unprefilled tokens counted from
            # it) takes the better tier, as the engine's cached_tokens does.
            assert decision["hit_tokens"][0] < cached == predicted
            assert subscriber.exact and subscriber.counters.unresolved_hashes == 0

        try:
            await with_router(router, body)
        finally:
            await engine_server.close()

    run(scenario)


@pytest.mark.parametrize("capacity_blocks", [0, 70])
def test_the_full_tier_holds_the_prompts_engines_prefilled_within_its_capacity(
    capacity_blocks: int, caplog: pytest.LogCaptureFixture
) -> None:
    """``--global-tier full``: every prompt an engine answered, the least recently used
    going first once a capacity is set, as the simulator's global tier keeps them."""
    caplog.set_level(logging.INFO, logger="smetric.serve")

    async def body(client, url, router, engines) -> None:
        s0, s1 = await blocks_of(router, 0, 0), await blocks_of(router, 1, 0)
        shared = int(np.argmin(s0 == s1))  # leading blocks both sessions share
        await chat(client, url, conversation(0, 0))
        await chat(client, url, conversation(1, 0))
        await chat(client, url, conversation(0, 1))
        global_hits = [line["global_hit_tokens"] for line in routes(caplog)]
        # The second session's unique blocks push the first one's tail out of 70 blocks.
        evicted = max(len(s0) + len(s1) - shared - capacity_blocks, 0) if capacity_blocks else 0
        assert global_hits == [0, shared * BS, (len(s0) - evicted) * BS]
        assert 0 < shared < len(s0) and (evicted > 0) == (capacity_blocks > 0)

    run(lambda: with_cluster(2, body, global_tier="full", global_tier_tokens=capacity_blocks * BS))


# Prompts here are a few hundred tokens, so the constants are scaled for a move's costs
# to compare as they do for 100 k-token histories on real hardware: a fetch is nearly
# free, a recompute slow, and crowding an engine's decode steps costs in between.
COST_SPEC = "smetric_cost:prefill_tps=1000,fetch_tps=1e9,kv_read_s=1e-6"


@pytest.mark.parametrize(("capacity_tokens", "branch"), [(0, "move_fetch"), (BS, "sticky")])
def test_smetric_cost_moves_a_session_off_a_busy_engine_only_where_a_fetch_backs_it(
    capacity_tokens: int, branch: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The session's home engine holds every in-flight prompt token (its previous turn is
    still streaming), which slows each decode step there. With the session in the global
    tier the follow-up moves and fetches its history; with a tier too small to hold it the
    move would recompute it, and it stays. Each decision is the one the simulator's policy
    makes on the same view, and the token load is the simulator's: in-flight prompt
    tokens."""
    caplog.set_level(logging.INFO, logger="smetric.serve")

    async def body(client, url, router, engines) -> None:
        home, _ = await chat(client, url, conversation(0, 0))
        payload = {"messages": conversation(0, 1), "max_tokens": 50_000, "stream": True}
        async with client.post(url + "/v1/chat/completions", json=payload) as long_stream:
            await long_stream.content.readline()
            where, _ = await chat(client, url, conversation(0, 2))
        assert (where == home) == (branch == "sticky")
        lines = routes(caplog)
        assert [line["branch"] for line in lines][2] == branch
        held = lines[1]["prompt_tokens"]
        assert sorted(lines[2]["inflight_prompt_tokens"]) == [0.0, 0.0, held]
        policy = make_policy(COST_SPEC)
        assert isinstance(policy, SMetricCost)
        for line in lines:
            view = ClusterView(
                hit_tokens=line["hit_tokens"],
                inflight_requests=line["inflight_requests"],
                unprefilled_tokens=line["unprefilled_tokens"],
                inflight_prompt_tokens=line["inflight_prompt_tokens"],
                global_hit_tokens=line["global_hit_tokens"],
            )
            request = RoutingRequest(line["turn"], line["prompt_tokens"], line["est_hit_tokens"])
            decision = policy.route(request, view)
            assert decision.branch == line["branch"]
            chosen = [e.url for e in router.engines].index(line["engine"])
            if decision.branch == "sticky":
                assert decision.instance == chosen
            else:  # ties go round-robin, so any engine as cheap as the policy's choice
                costs = (
                    policy.costs(request, view) if line["turn"] else line["inflight_prompt_tokens"]
                )
                assert costs[chosen] == min(costs)

    run(
        lambda: with_cluster(
            3,
            body,
            policy=COST_SPEC,
            global_tier="full",
            global_tier_tokens=capacity_tokens,
        )
    )


def test_unprefilled_tokens_count_the_global_hit_as_the_simulator_does() -> None:
    """A request sent where its prefix is not cached, but which the global tier holds,
    queues only what neither tier has: the simulator's ``Instance.enqueue`` counts
    ``prompt - reusable(max(local, global))`` for Dynamo's load, and so does the router."""

    async def body(client, url, router: Router, held: list[HeldEngine]) -> None:
        first = await held_chat(client, url, held_conversation(0))
        other = next(e for e in router.engines if e.url != first)
        holder = held[router.engines.index(other)]
        long = held_conversation(1, "HOLD " + "new context " * 40)  # round-robin: other
        facts = await router.analyzer.analyze({"messages": long}, "chat")
        stored = await router.analyzer.analyze({"messages": held_conversation(0)}, "chat")
        assert other.predicted_hit(facts.blocks, BS, facts.prompt_tokens) == 0
        global_hit = reusable_hit_tokens(len(stored.blocks), facts.prompt_tokens, BS)
        assert global_hit > 0
        payload = {"model": "m", "messages": long, "stream": True}
        sent = asyncio.create_task(client.post(url + "/v1/chat/completions", json=payload))
        await eventually(lambda: other.inflight == 1)
        assert other.unprefilled == facts.prompt_tokens - global_hit
        holder.first_token.set()
        holder.finish.set()
        response = await sent
        assert int(response.headers["x-smetric-predicted-hit-tokens"]) == global_hit
        await response.read()
        response.close()

    asyncio.run(with_held_engines(2, "round_robin", body, global_tier="full"))


def test_every_worker_learns_the_prompts_the_others_served() -> None:
    """With ``--workers``, the record standing for a full tier travels between workers
    over their datagram sockets, beside the engines' prefix indexes."""

    async def scenario() -> None:
        peers = PeerViews(2)
        served = [ServedPrompts(None), ServedPrompts(None)]
        engines = [[Engine("http://127.0.0.1:1", 64)] for _ in range(2)]
        contexts = [peers.join(engines[w], w, served[w])(None) for w in range(2)]  # type: ignore[arg-type]
        for context in contexts:
            await anext(context)
        blocks = np.arange(10, 20, dtype=np.int64)
        served[0].record(blocks)
        engines[0][0].remember(blocks)
        await eventually(lambda: served[1].match(blocks) == 10)
        await eventually(lambda: engines[1][0].view.match(blocks, BS) == 10)
        for context in contexts:
            with pytest.raises(StopAsyncIteration):
                await anext(context)

    asyncio.run(scenario())


def test_global_tier_settings_are_checked() -> None:
    engines = [Engine("http://127.0.0.1:1", 64)]
    assert global_tier_from("none", 0, BS, engines) is None
    assert isinstance(global_tier_from("full", 0, BS, engines), ServedPrompts)
    for kind, tokens, message in [
        ("events", 0, "needs an engine with kv_events"),
        ("everything", 0, "unknown global tier"),
        ("none", 1024, "applies to --global-tier full only"),
        ("full", -1, ">= 0 tokens"),
        ("full", BS - 1, "holds no block"),
    ]:
        with pytest.raises(ValueError, match=message):
            global_tier_from(kind, tokens, BS, engines)


def test_the_yaml_router_section_sets_the_global_tier(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("router: {global_tier: full, global_tier_tokens: 4096}\n")
    router = load_config(ServeConfig, config).router
    assert (router.global_tier, router.global_tier_tokens) == ("full", 4096)
    config.write_text("router: {global_tier: cpu}\n")
    with pytest.raises(
        ValueError, match=r"c\.yaml: router\.global_tier 'cpu': use one of none, events"
    ):
        load_config(ServeConfig, config)
