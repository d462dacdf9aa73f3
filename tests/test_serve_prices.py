"""The live router's price feed: what the learner learns reaches the policy and the
Prometheus gauge; a spec's values and ``learn=0`` are left alone."""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Gauge

from smetric.core.policies import make_policy
from smetric.serve.prices import PriceFeed
from smetric.testing.prices import H20_PRICES, model_engines


def gauge() -> tuple[Gauge, CollectorRegistry]:
    registry = CollectorRegistry()
    return Gauge("smetric_learned_price", "x", ["constant"], registry=registry), registry


def test_the_feed_retunes_the_policy_and_exports_what_it_learned() -> None:
    spec = "smetric_cost:prefill_tps=28400,attn_tokens=22000,fetch_tps=50000"
    policy = make_policy(spec.replace("fetch_tps=50000", "fetch_tps=50000,learn=1"))
    prices, registry = gauge()
    feed = PriceFeed(policy, spec, prices)
    assert registry.get_sample_value("smetric_learned_price", {"constant": "prefill_tps"}) == 28400
    for done in itertools.islice(model_engines(H20_PRICES, 0), 1_500):
        feed.observe(done)
    learned = registry.get_sample_value("smetric_learned_price", {"constant": "kv_read_s"})
    assert abs(learned / H20_PRICES["kv_read_s"] - 1) < 0.1
    assert policy.kv_read_s == learned  # type: ignore[attr-defined]
    # Given in the spec: never learned, whatever the replies say.
    assert policy.prefill_tps == 28400  # type: ignore[attr-defined]
    assert policy.fetch_tps == 50000  # type: ignore[attr-defined]


def test_learn_0_feeds_nothing() -> None:
    policy = make_policy("smetric_cost:learn=0")
    feed = PriceFeed(policy, "smetric_cost:learn=0", gauge()[0])
    assert not feed.learning
    before = policy.prefill_tps  # type: ignore[attr-defined]
    for done in itertools.islice(model_engines(H20_PRICES, 0), 100):
        feed.observe(done)
    assert policy.prefill_tps == before  # type: ignore[attr-defined]
