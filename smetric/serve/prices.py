"""Learned prices in the live router: every completed request teaches the policy.

``smetric_cost`` prices work in seconds; in front of real engines nothing tells the router
what a second of their work is, so it learns the rates from their replies
(``core/prices.py``): the usage each engine reports, the time to first token and the gaps
between a stream's chunks, against what the router itself counted when it routed the
request and when its first token came back. The estimates go to the policy as they are
refitted, to ``smetric_learned_price{constant}`` and to the log.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable

from prometheus_client import Gauge

from smetric.core.policies import RoutingPolicy, spec_params
from smetric.core.prices import Completion, PriceLearner, Retunable, price_learner
from smetric.serve import forwarding
from smetric.serve.engines import Engine

log = logging.getLogger("smetric.serve")


class PriceFeed:
    """Feeds one router's price learner and passes what it learns on to the policy."""

    def __init__(self, policy: RoutingPolicy, spec: str, gauge: Gauge) -> None:
        self.policy = policy
        self.learner: PriceLearner | None = price_learner(policy, spec_params(spec)[1])
        self.gauge = gauge
        if self.learner is not None:
            self._export(self.learner.estimates)

    @property
    def learning(self) -> bool:
        return self.learner is not None

    def observe(self, done: Completion) -> None:
        """Take one finished request; retune the policy when the learner refitted."""
        if self.learner is None:
            return
        values = self.learner.observe(done)
        if values is None:
            return
        assert isinstance(self.policy, Retunable)  # it has a learner
        self.policy.retune(**self.learner.learned())
        self._export(values)
        log.info(
            json.dumps(
                {
                    "event": "learned_prices",
                    "requests": self.learner.observed,
                    **{k: float(f"{v:.4g}") for k, v in self.learner.learned().items()},
                }
            )
        )

    def observer(self, engine_of: Callable[[str], Engine | None]) -> forwarding.CompletionObserver:
        """A completion observer (``Router.observers``) that feeds this learner, finding
        each request's engine by URL with ``engine_of``."""

        def observe(completion: forwarding.Completion) -> None:
            engine = engine_of(completion.engine) if completion.engine else None
            done = observed(completion, engine)
            if done is not None:
                self.observe(done)

        return observe

    def _export(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.gauge.labels(name).set(value)


def observed(completion: forwarding.Completion, engine: Engine | None) -> Completion | None:
    """What the learner takes of a completed request, or None when it tells nothing: it
    failed, went to a disaggregated prefill (whose timing is the pair's), or the engine
    did not report its cached tokens.

    A stream's decode is its chunks after the first (vLLM sends a token a chunk); the
    prompt tokens in flight on its engine are the mean of the router's count at the first
    chunk and at the end (this request's own included), and the prefills routed beside
    it the router's count of unprefilled tokens sent there in that time.
    """
    cached = completion.cached_tokens
    ttft = completion.ttft_s
    if completion.outcome != "completed" or completion.prefill_engine is not None:
        return None
    if cached is None or ttft is None or engine is None:
        return None
    prompt = completion.facts.prompt_tokens
    gaps = completion.chunk_gaps_s
    streamed = completion.stream and gaps and not math.isnan(completion.first_token_tokens)
    return Completion(
        prompt_tokens=prompt,
        cached_tokens=cached,
        predicted_local_tokens=completion.predicted_local_tokens,
        queued_tokens=completion.queued_tokens,
        ttft_s=ttft,
        output_tokens=len(gaps) + 1 if streamed else 0,
        decode_s=sum(gaps) if streamed else math.nan,
        decode_tokens=(
            (completion.first_token_tokens + engine.total_inflight_tokens() + prompt) / 2
            if streamed
            else math.nan
        ),
        decode_prefill_tokens=(
            engine.routed_unprefilled - completion.first_token_routed if streamed else math.nan
        ),
    )
