"""The price learner: it recovers known constants from a router's observations, from any
start, and learns only what a spec leaves open."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from smetric.core import ClusterView, RoutingRequest, make_policy
from smetric.core.policies import Observation, spec_params
from smetric.core.policies.prices import LEARNABLE, PriceLearner, nonnegative_quadratic
from smetric.sim.config import SimConfig
from smetric.sim.run import simulate
from smetric.testing.prices import H20_PRICES, model_engines, requests_to_converge
from smetric.trace.load import load_trace

TRUE = H20_PRICES


def estimates(learner: PriceLearner, stream: Iterator[Observation], requests: int):
    """``(requests seen, estimates)`` after each refit over ``requests`` completions."""
    for done in itertools.islice(stream, requests):
        values = learner.on_complete(done)
        if values is not None:
            yield learner.observed, values


@pytest.mark.parametrize("factor", [2.0, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_constant_off_by_2x_converges_within_2000_requests(factor: float, seed: int) -> None:
    learner = PriceLearner({k: v * factor for k, v in TRUE.items()})
    since = requests_to_converge(estimates(learner, model_engines(TRUE, seed), 3_000), TRUE)
    assert learner.observed == 3_000
    assert all(n is not None and n <= 2_000 for n in since.values()), since


def test_what_the_spec_gives_is_never_learned() -> None:
    learner = PriceLearner(
        {k: v * 2 for k, v in TRUE.items()}, fixed=("fetch_tps", "output_tokens")
    )
    for done in itertools.islice(model_engines(TRUE, 0), 2_000):
        learner.on_complete(done)
    assert learner.estimates["fetch_tps"] == 2 * TRUE["fetch_tps"]
    assert learner.estimates["output_tokens"] == 2 * TRUE["output_tokens"]
    assert set(learner.learned()) == set(LEARNABLE) - {"fetch_tps", "output_tokens"}
    assert abs(learner.estimates["prefill_tps"] / TRUE["prefill_tps"] - 1) < 0.1


def test_a_constant_without_evidence_keeps_its_start() -> None:
    """No global tier: nothing is ever fetched, so the fetch rate stays as it started."""
    learner = PriceLearner({k: v * 2 for k, v in TRUE.items()})
    for done in itertools.islice(model_engines(TRUE, 0, fetches=False), 1_000):
        learner.on_complete(done)
    assert learner.estimates["fetch_tps"] == pytest.approx(2 * TRUE["fetch_tps"])
    assert abs(learner.estimates["prefill_tps"] / TRUE["prefill_tps"] - 1) < 0.1


def test_requests_without_a_first_token_are_not_observed() -> None:
    learner = PriceLearner(TRUE, refit_every=1)
    assert learner.on_complete(Observation(1000, 0, 0, 0.0, float("nan"), 0)) is None
    assert learner.observed == 0


def test_nonnegative_quadratic_matches_the_best_active_set() -> None:
    """Against brute force: the best of every subset of free coefficients whose own
    solution is non-negative."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        k = int(rng.integers(1, 6))
        a = rng.normal(size=(k + 3, k))
        gram, moment = a.T @ a + 1e-3 * np.eye(k), a.T @ rng.normal(size=k + 3)

        def value(x: np.ndarray, gram=gram, moment=moment) -> float:
            return 0.5 * x @ gram @ x - moment @ x

        best = 0.0
        for mask in itertools.product([False, True], repeat=k):
            free = np.array(mask)
            if not free.any():
                continue
            x = np.zeros(k)
            x[free] = np.linalg.solve(gram[np.ix_(free, free)], moment[free])
            if (x >= 0).all():
                best = min(best, value(x))
        found = nonnegative_quadratic(gram, moment)
        assert (found >= 0).all()
        assert value(found) == pytest.approx(best, abs=1e-9)


def test_retuned_prices_change_the_decision() -> None:
    """A follow-up whose 1,000 cached tokens sit behind a 1,501-token queue: with
    ``attn_tokens=1000`` the recompute elsewhere (1.705 s less 0.205 s) is cheaper than
    the 1.501 s wait; with attention ten times dearer (``attn_tokens=100``) the
    recompute costs 7.15 s against 1.15 s plus the wait, and the session stays."""
    spec = "smetric_cost:prefill_tps=1000,attn_tokens=1000,queue_depth=0,output_tokens=0"
    policy = make_policy(spec + ",work_weight=1,decode_weight=0")
    view = ClusterView(
        hit_tokens=[1000, 0],
        inflight_requests=[1.0, 1.0],
        unprefilled_tokens=[1501, 0],
        inflight_prompt_tokens=[0, 0],
    )
    request = RoutingRequest(turn=1, prompt_tokens=1100, est_hit_tokens=1000)
    assert policy.route(request, view) == (1, "move_recompute")
    policy.retune(attn_tokens=100.0)
    assert policy.route(request, view) == (0, "sticky")
    with pytest.raises(ValueError, match="not one of its learned"):
        policy.retune(work_weight=3.0)


def test_learn_0_and_policies_without_prices_have_no_learner() -> None:
    assert make_policy("smetric_cost:learn=0").learner() is None
    assert make_policy("least_load").learner() is None
    spec = "smetric_cost:fetch_tps=5000"
    learner = make_policy(spec).learner(spec_params(spec)[1])
    assert isinstance(learner, PriceLearner)
    assert learner.fixed == {"fetch_tps"}
    assert learner.prior["fetch_tps"] == 5000.0


def test_the_simulator_learns_from_its_requests_deterministically() -> None:
    """The learned prices land in the run's summary, two runs learn the same, and learn=0
    learns nothing."""
    trace = load_trace("sample:weka")
    config = (
        SimConfig()
        .override("cluster", instances=2, global_capacity="full")
        .override("workload", session_rate=0.02, duration_s=600.0)
    )
    first = simulate(trace, config, "smetric_cost")
    again = simulate(trace, config, "smetric_cost")
    assert first.summary["learned_from"] > 100
    assert first.summary["learned_params"] == again.summary["learned_params"]
    assert set(first.summary["learned_params"]) == set(LEARNABLE)
    fixed = simulate(trace, config, "smetric_cost:learn=0")
    assert "learned_params" not in fixed.summary
