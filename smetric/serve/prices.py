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

from prometheus_client import Gauge

from smetric.core.policies import RoutingPolicy, spec_params
from smetric.core.prices import Completion, PriceLearner, price_learner

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
        self.policy.retune(**self.learner.learned())  # type: ignore[attr-defined]
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

    def _export(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.gauge.labels(name).set(value)
