"""Learning in the live router: every completed request teaches the policy.

A policy that learns from its requests (``RoutingPolicy.learner``; ``smetric_cost``
learns the rates of the engines behind it, which nothing else tells the router) gets the
same facts here as in the simulator: the usage each engine reports, the time to first
token and the gaps between a stream's chunks, against what the router itself counted
when it routed the request and when its first token came back. What the policy takes
goes to ``smetric_learned_price{constant}`` and to the log as it changes.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

from prometheus_client import Gauge

from smetric.core.policies import Learning, Observation, RoutingPolicy, spec_params
from smetric.serve import forwarding
from smetric.serve.engines import Engine

log = logging.getLogger("smetric.serve")


class PriceFeed:
    """Feeds one router's policy what its requests came to, where the policy learns."""

    def __init__(self, policy: RoutingPolicy, spec: str, gauge: Gauge) -> None:
        self.policy = policy
        # None: the policy learns nothing.
        self.learning: Learning | None = policy.learning(spec_params(spec)[1])
        self.gauge = gauge
        if self.learning is not None:
            self._export()

    def observe(self, done: Observation) -> None:
        """Take one finished request; show what the policy took when it learned."""
        if self.learning is None or self.learning.on_complete(done) is None:
            return
        self._export()
        learner = self.learning.learner
        log.info(
            json.dumps(
                {
                    "event": "learned_prices",
                    "requests": learner.observed,
                    **{k: float(f"{v:.4g}") for k, v in learner.learned().items()},
                }
            )
        )

    def observer(self, engine_of: Callable[[str], Engine | None]) -> forwarding.CompletionObserver:
        """A completion observer (``Router.observers``) that feeds this policy, finding
        each request's engine by URL with ``engine_of``."""

        def observe(completion: forwarding.Completion) -> None:
            engine = engine_of(completion.engine) if completion.engine else None
            done = observed(completion, engine)
            if done is not None:
                self.observe(done)

        return observe

    def _export(self) -> None:
        """The values the policy prices with now of every parameter it may learn (a value
        the spec gave is shown as given)."""
        for name, value in self.policy.learnable().items():
            self.gauge.labels(name).set(value)


def observed(completion: forwarding.Completion, engine: Engine | None) -> Observation | None:
    """What a learner takes of a completed request, or None when it tells nothing: it
    failed, went to a disaggregated prefill (whose timing is the pair's), or the engine
    did not report its cached tokens.

    A stream's decode is its chunks after the first (vLLM sends a token a chunk); the
    prompt tokens in flight on its engine are the mean of the router's count at the first
    chunk and at the end (this request's own included), and the prefills routed beside
    it the router's count of unprefilled tokens sent there in that time.
    """
    cached = completion.cached_tokens
    ttft = completion.ttft_s
    done = completion.outcome is forwarding.Outcome.COMPLETED
    if not done or completion.prefill_engine is not None:
        return None
    routed = completion.routed
    if cached is None or ttft is None or engine is None or routed is None:
        return None
    prompt = completion.facts.prompt_tokens
    chunks = completion.decode_chunks
    streamed = completion.stream and chunks and not math.isnan(completion.first_token_tokens)
    return Observation(
        prompt_tokens=prompt,
        cached_tokens=cached,
        predicted_local_tokens=routed.predicted_local_tokens,
        queued_tokens=routed.queued_tokens,
        ttft_s=ttft,
        output_tokens=chunks + 1 if streamed else 0,
        decode_s=completion.decode_s if streamed else math.nan,
        decode_tokens=(
            (completion.first_token_tokens + engine.total_inflight_tokens() + prompt) / 2
            if streamed
            else math.nan
        ),
        decode_prefill_tokens=(
            engine.routed_unprefilled - completion.first_token_routed if streamed else math.nan
        ),
    )
