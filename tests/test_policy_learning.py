"""A policy that learns from its requests is one file: the one below, written here and
registered for these tests only, learns in the simulator and behind the live router,
and neither driver knows its parameter's name."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import polars as pl
import pytest

from smetric.core.policies import (
    POLICIES,
    Choice,
    ClusterView,
    Learning,
    Observation,
    RoutingPolicy,
    RoutingRequest,
    make_policy,
)
from smetric.core.settings import setting
from smetric.sim.config import SimConfig
from smetric.sim.run import simulate
from smetric.trace.load import load_trace

# ---------------------------------------------------------------- the policy's file


@dataclass(slots=True, kw_only=True)
class MeanPromptSplit(RoutingPolicy):
    """Prompts longer than the mean of the requests completed so far go to the first
    instance, the rest to the last."""

    name = "mean_prompt_split"
    branches = ("long", "short")

    mean_prompt: float = setting(
        0.0, "Mean prompt tokens of the requests completed so far.", ge=0, source="learned"
    )

    def route(self, request: RoutingRequest, view: ClusterView) -> Choice:
        if request.prompt_tokens > self.mean_prompt:
            return Choice(0, "long")
        return Choice(len(view.hit_tokens) - 1, "short")

    def learner(self, given: Collection[str] = ()) -> MeanPrompt | None:
        return None if "mean_prompt" in given else MeanPrompt()


class MeanPrompt:
    """The mean prompt of every completed request, new at each completion."""

    def __init__(self) -> None:
        self.observed = 0
        self.mean = 0.0

    def on_complete(self, done: Observation) -> dict[str, float]:
        self.observed += 1
        self.mean += (done.prompt_tokens - self.mean) / self.observed
        return self.learned()

    def learned(self) -> dict[str, float]:
        return {"mean_prompt": self.mean}


# ---------------------------------------------------------------------------- tests


@pytest.fixture(autouse=True)
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(POLICIES, MeanPromptSplit.name, MeanPromptSplit)
    yield


def test_the_simulator_feeds_it_every_completed_request() -> None:
    trace = load_trace("sample:weka")
    config = (
        SimConfig()
        .override("cluster", instances=2)
        .override("workload", session_rate=0.02, duration_s=300.0)
    )
    result = simulate(trace, config, "mean_prompt_split")
    done = result.requests.filter(pl.col("finished_s").is_not_null() & ~pl.col("rejected"))
    assert result.summary.learned_from == done.height > 10
    assert result.summary.learned_params is not None
    learned = result.summary.learned_params["mean_prompt"]
    assert learned == pytest.approx(done["prompt_tokens"].mean(), rel=1e-9)
    # It started at 0, so everything was long until the first completion moved it.
    assert set(done["branch"]) == {"long", "short"}
    given = simulate(trace, config, "mean_prompt_split:mean_prompt=1e9")
    assert given.summary.learned_params is None and given.summary.learned_from is None
    assert set(given.requests.filter(~pl.col("rejected"))["branch"]) == {"short"}


async def route_behind_router(prompts: list[int]) -> tuple[RoutingPolicy, Learning | None, str]:
    """One streamed first turn per prompt size (words), in order, through a router with
    the policy in front of two mock engines on loopback: its policy, its learning and
    its /metrics text."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from smetric.engine import EngineConfig, create_app
    from smetric.serve.app import Router, RouterSettings
    from smetric.serve.engines import Engine

    config = EngineConfig(speed=0.05, kv_blocks=4096, default_max_tokens=4)
    servers = [TestServer(create_app(config), host="127.0.0.1") for _ in range(2)]
    for server in servers:
        await server.start_server()
    engines = [Engine(f"http://127.0.0.1:{s.port}", 4096) for s in servers]
    router = Router(engines, RouterSettings(policy="mean_prompt_split", health_interval_s=60))
    front = TestServer(router.app(), host="127.0.0.1")
    await front.start_server()
    url = f"http://127.0.0.1:{front.port}"
    try:
        async with asyncio.timeout(60), aiohttp.ClientSession() as client:
            for number, words in enumerate(prompts):
                chat = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"q{number} " + "word " * words}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                async with client.post(url + "/v1/chat/completions", json=chat) as reply:
                    assert reply.status == 200
                    assert "[DONE]" in await reply.text()
            async with client.get(url + "/metrics") as reply:
                metrics = await reply.text()
    finally:
        await front.close()
        for server in servers:
            await server.close()
    return router.core.policy, router.prices.learning, metrics


@pytest.mark.server
def test_the_live_router_feeds_it_every_completed_request() -> None:
    """A long prompt, then a short one, twice: once the long one has completed the short
    one is below the mean and goes to the other engine, so what it learned routed."""
    policy, learning, metrics = asyncio.run(route_behind_router([800, 50, 800, 50]))
    assert isinstance(policy, MeanPromptSplit) and learning is not None
    learner = learning.learner
    assert isinstance(learner, MeanPrompt) and learner.observed == 4
    assert policy.mean_prompt == learner.mean > 0
    assert f'smetric_learned_price{{constant="mean_prompt"}} {learner.mean}' in metrics
    assert 'smetric_routing_decisions_total{branch="long"} 2.0' in metrics
    assert 'smetric_routing_decisions_total{branch="short"} 2.0' in metrics


def test_a_spec_that_gives_its_parameter_leaves_nothing_to_learn() -> None:
    assert make_policy("mean_prompt_split:mean_prompt=5").learning({"mean_prompt"}) is None
    assert make_policy("mean_prompt_split").learning() is not None
