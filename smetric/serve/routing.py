"""The routing core: a request's view of the engines, the policy's decision, its explanation.

Pure of HTTP, so every front door routes alike: ``smetric serve``'s dispatchers and an
Envoy endpoint picker call the same ``RoutingCore.decide`` on ``Engine`` objects from the
same ``serve.pool.EnginePool``. The view is the one the simulator builds: each engine's
local prefix hit (its ``KVView``), in-flight requests (or a fresh scrape's queue, if
larger) as load, their prompt tokens and unprefilled tokens, and what the global tier
holds of the prompt. After an engine took the request, ``served`` records the prompt in
its view and the global tier.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from smetric.core.blocks import reusable_hit_tokens
from smetric.core.conversation import RequestFacts
from smetric.core.policies import ClusterView, make_policy
from smetric.serve.engines import INFLIGHT, INFLIGHT_TOKENS, UNPREFILLED, Engine
from smetric.serve.global_tier import GlobalTierView
from smetric.serve.identity import ANONYMOUS, AgentIdentity


@dataclass(frozen=True, slots=True)
class Routed:
    """What the router decided for one request, as its completion record keeps it."""

    branch: str
    predicted_hit_tokens: int = 0
    # For learning prices (serve/prices.py): the predicted local hit on the chosen engine
    # and the unprefilled tokens queued there when it was chosen.
    predicted_local_tokens: int = 0
    queued_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes, why, and what the router expects the engine to hold."""

    engine: Engine
    branch: str
    predicted_hit_tokens: int
    view: ClusterView
    hits: list[int]
    global_hit_tokens: int | None
    chosen: int  # the engine's place in the candidates and the view

    def routed(self) -> Routed:
        chosen = self.chosen
        return Routed(
            self.branch,
            self.predicted_hit_tokens,
            self.hits[chosen],
            self.view.unprefilled_tokens[chosen],
        )


class RoutingCore:
    """One policy over a cluster's engines; ``engines`` given per call, so each caller
    chooses among its own candidates (healthy ones, one role's, ones not yet tried)."""

    def __init__(
        self,
        policy: str,
        block_size: int,
        staleness_s: float,
        global_tier: GlobalTierView | None = None,
        load: str = "inflight_requests",
    ) -> None:
        self.policy = make_policy(policy, load=load)
        self.block_size = block_size
        self.staleness_s = staleness_s
        self.global_tier = global_tier

    def view(
        self,
        facts: RequestFacts,
        engines: Sequence[Engine],
    ) -> tuple[ClusterView, list[int], int | None]:
        """The cluster as the policy sees it for this request, with each engine's local
        hit and the global tier's (None: unknown)."""
        bs = self.block_size
        hits = [e.predicted_hit(facts.blocks, bs, facts.prompt_tokens) for e in engines]
        totals = [e.totals() for e in engines]
        now = time.monotonic()
        tier = self.global_tier
        global_hit = (
            None
            if tier is None
            else reusable_hit_tokens(tier.match(facts.blocks), facts.prompt_tokens, bs)
        )
        view = ClusterView(
            hit_tokens=hits,
            inflight_requests=[
                e.load(now, self.staleness_s, t[INFLIGHT])
                for e, t in zip(engines, totals, strict=True)
            ],
            unprefilled_tokens=[float(t[UNPREFILLED]) for t in totals],
            instance_ids=[e.number for e in engines],
            inflight_prompt_tokens=[float(t[INFLIGHT_TOKENS]) for t in totals],
            global_hit_tokens=global_hit,
        )
        return view, hits, global_hit

    def decide(
        self,
        facts: RequestFacts,
        engines: Sequence[Engine],
    ) -> Decision:
        """The policy's pick among ``engines`` (at least one).

        The predicted hit is the better of the engine's local hit and the global tier's,
        as the simulator's instance counts a queued request's unprefilled tokens and as
        vLLM reports ``cached_tokens`` (tokens a KV connector loads count as cached)."""
        view, hits, global_hit = self.view(facts, engines)
        choice = self.policy.route(facts.routing_request(), view)
        predicted = hits[choice.instance]
        if global_hit is not None:
            predicted = max(predicted, global_hit)
        instance = choice.instance
        return Decision(
            engines[instance], choice.branch, predicted, view, hits, global_hit, instance
        )

    def served(self, engine: Engine, blocks: np.ndarray) -> None:
        """The engine prefilled these blocks: it now caches them, and a global tier that
        keeps every prefill holds them too."""
        engine.remember(blocks)
        if self.global_tier is not None:
            self.global_tier.record(blocks)


def explain(
    decision: Decision, facts: RequestFacts, identity: AgentIdentity = ANONYMOUS
) -> dict[str, Any]:
    """The decision as one JSON-ready log record."""
    view = decision.view
    return {
        "event": "route",
        "engine": decision.engine.url,
        "branch": decision.branch,
        "turn": facts.turn,
        "prompt_tokens": facts.prompt_tokens,
        "est_hit_tokens": facts.est_hit_tokens,
        "predicted_hit_tokens": decision.predicted_hit_tokens,
        "hit_tokens": decision.hits,
        "global_hit_tokens": decision.global_hit_tokens,
        "inflight_requests": view.inflight_requests,
        "inflight_prompt_tokens": view.inflight_prompt_tokens,
        "unprefilled_tokens": view.unprefilled_tokens,
        **identity.labels(facts.turn),
    }
