"""Routing policies: hand-worked decisions, SMetric's guard edges, tie breaks, the registry."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smetric.core import (
    POLICY_NAMES,
    Choice,
    ClusterView,
    RoutingRequest,
    make_policy,
    policy_params,
)
from smetric.core.policies.linear import Linear
from smetric.core.policies.session_hash import rendezvous
from smetric.core.policies.smetric import SMetric
from smetric.core.policies.ties import TieBreaker


def view(hits: list[int], loads: list[float], prefill: list[float] | None = None) -> ClusterView:
    return ClusterView(hits, loads, loads if prefill is None else prefill)


def follow_up(est_hit: int = 1000, prompt: int = 1100, key: str = "") -> RoutingRequest:
    return RoutingRequest(turn=1, prompt_tokens=prompt, est_hit_tokens=est_hit, session_key=key)


FIRST = RoutingRequest(turn=0, prompt_tokens=1000, est_hit_tokens=0)

# (policy spec, request, view, expected decision) on a fresh policy, so ties start at 0.
CASES = [
    # SMetric: a first turn ignores even a full hit.
    ("smetric", FIRST, view([0, 0, 1000], [3, 1, 2]), (1, "first_turn_balance")),
    ("smetric", follow_up(), view([0, 800, 0], [2, 3, 1]), (1, "sticky")),
    # Overload guard: mean 3, so load 6 is exactly 2x the mean and sticks; 7 does not.
    ("smetric", follow_up(), view([900, 0, 0, 0], [6, 2, 1, 3]), (0, "sticky")),
    ("smetric", follow_up(), view([900, 0, 0, 0], [7, 2, 1, 3]), (2, "overload_fallback")),
    ("smetric:overload=1.5", follow_up(), view([900, 0, 0], [3, 1, 2]), (0, "sticky")),
    ("smetric:overload=1.5", follow_up(), view([900, 0, 0], [4, 1, 2]), (1, "overload_fallback")),
    # Eviction guard is strict: exactly half of est_hit counts as evicted.
    ("smetric", follow_up(), view([500, 0, 0], [2, 1, 3]), (1, "evicted_fallback")),
    ("smetric", follow_up(), view([501, 0, 0], [2, 1, 3]), (0, "sticky")),
    ("smetric:hit_ratio=0.3", follow_up(), view([301, 0, 0], [2, 1, 3]), (0, "sticky")),
    ("smetric", follow_up(est_hit=0), view([0, 0], [1, 0]), (1, "evicted_fallback")),
    # When both guards trip, the overload one names the branch.
    ("smetric", follow_up(), view([100, 0, 0], [9, 1, 2]), (1, "overload_fallback")),
    # Equal best hits go to the lower load, then the lower index.
    ("smetric", follow_up(), view([800, 800, 0], [3, 2, 0]), (1, "sticky")),
    ("smetric", follow_up(), view([0, 800, 800], [1, 2, 2]), (1, "sticky")),
    # An idle cluster is not overloaded anywhere.
    ("smetric", follow_up(), view([0, 900, 0], [0, 0, 0]), (1, "sticky")),
    # Linear: scores 0.9125, 0.14, 0.1 at lam 0.9; 0.5625, 0.3, 0.5 at lam 0.5.
    ("linear", follow_up(prompt=1000), view([0, 900, 1000], [1, 4, 8]), (2, "score")),
    ("linear:lam=0.5", follow_up(prompt=1000), view([0, 900, 1000], [1, 4, 8]), (1, "score")),
    ("linear:lam=1", follow_up(prompt=1000), view([0, 900, 1000], [1, 4, 8]), (2, "score")),
    ("linear:lam=1", follow_up(prompt=1000), view([0, 1000, 1000], [0, 9, 0]), (1, "score")),
    ("linear:lam=0", follow_up(prompt=1000), view([0, 900, 1000], [1, 4, 8]), (0, "score")),
    ("linear:lam=0", follow_up(prompt=1000), view([0, 900, 1000], [0, 0, 0]), (0, "score")),
    ("linear", follow_up(prompt=0), view([0, 0, 0], [2, 1, 3]), (1, "score")),
    # LMetric: 100*4 = 400 beats 1000*1; then 1000*10, 1000*1, 500*1.
    ("lmetric", follow_up(prompt=1000), view([900, 0, 0], [3, 0, 0]), (0, "score")),
    ("lmetric", follow_up(prompt=1000), view([900, 0, 500], [9, 0, 0]), (2, "score")),
    ("least_load", follow_up(), view([1000, 0, 0], [3, 1, 2]), (1, "least_load")),
    # Dynamo reads prefill_tokens, not load: 100+100, 2000+0, 0+1000.
    (
        "prefill_tokens",
        follow_up(prompt=1000),
        view([900, 1000, 0], [9, 0, 0], prefill=[100, 2000, 0]),
        (0, "score"),
    ),
    ("round_robin", follow_up(), view([1000, 0, 0], [9, 9, 0]), (0, "round_robin")),
    ("session_hash", FIRST, view([0, 0, 0], [3, 1, 2]), (1, "no_session_key")),
    # Cache-aware: a gap of 40 (> 32, and 40 > 0) is imbalance whatever the hits say.
    (
        "cache_aware",
        follow_up(prompt=1000),
        view([1000, 0, 0], [40, 0, 5]),
        (1, "imbalance_balance"),
    ),
    ("cache_aware", follow_up(prompt=1000), view([600, 0, 0], [10, 0, 5]), (0, "cache_hit")),
    (
        "cache_aware",
        follow_up(prompt=1000),
        view([500, 0, 0], [10, 0, 5]),
        (1, "low_match_balance"),
    ),
    ("cache_aware", follow_up(prompt=0), view([0, 0, 0], [1, 0, 5]), (1, "low_match_balance")),
    # A gap of 40 that is not also 2x the smaller load is still balanced.
    (
        "cache_aware:balance_rel_threshold=2",
        follow_up(prompt=1000),
        view([0, 600], [100, 60]),
        (1, "cache_hit"),
    ),
]


@pytest.mark.parametrize(("spec", "request_", "view_", "expected"), CASES)
def test_hand_worked_decisions(
    spec: str, request_: RoutingRequest, view_: ClusterView, expected: tuple[int, str]
) -> None:
    policy = make_policy(spec)
    decision = policy.route(request_, view_)
    assert decision == Choice(*expected)
    assert decision.branch in policy.branches


@pytest.mark.parametrize(
    ("values", "pointer", "expected"),
    [
        ([3, 1, 2], 0, 1),
        ([3, 1, 2], 2, 1),  # a unique minimum ignores the pointer
        ([0, 5, 0, 5], 0, 0),
        ([0, 5, 0, 5], 1, 2),  # first tie at or after the pointer
        ([0, 5, 0, 5], 3, 0),  # no tie after it: wrap
        ([0, 0], 7, 1),  # a pointer left over from a larger cluster wraps too
    ],
)
def test_round_robin_argmin(values: list[int], pointer: int, expected: int) -> None:
    ties = TieBreaker()
    for _ in range(pointer):
        ties.take(1 << 10)
    assert ties.argmin(values) == expected


@pytest.mark.parametrize("name", ["smetric", "least_load", "cache_aware", "session_hash"])
def test_equal_load_first_turns_spread_in_order(name: str) -> None:
    policy = make_policy(name)
    idle = view([0] * 4, [0] * 4)
    assert [policy.route(FIRST, idle).instance for _ in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_ties_skip_busier_instances_but_keep_rotating() -> None:
    policy = make_policy("least_load")
    uneven = view([0] * 4, [0, 5, 0, 5])
    assert [policy.route(FIRST, uneven).instance for _ in range(4)] == [0, 2, 0, 2]


def test_round_robin_cycles_and_follows_cluster_size() -> None:
    policy = make_policy("round_robin")
    three, two = view([0] * 3, [0] * 3), view([0] * 2, [0] * 2)
    picks = [policy.route(FIRST, three).instance for _ in range(4)]
    picks += [policy.route(FIRST, two).instance for _ in range(2)]
    assert picks == [0, 1, 2, 0, 1, 0]


def test_session_hash_is_sticky_and_ignores_load() -> None:
    policy = make_policy("session_hash")
    first = policy.route(follow_up(key="s-42"), view([0] * 8, [0] * 8))
    again = policy.route(follow_up(key="s-42"), view([0] * 8, [float(i) for i in range(8)][::-1]))
    assert first == again
    assert first.branch == "hash"
    assert first.instance == rendezvous("s-42", 8)


def test_session_hash_moves_about_one_in_n_keys_when_an_instance_joins() -> None:
    keys = [f"session-{i}" for i in range(1000)]
    before = [rendezvous(k, 8) for k in keys]
    after = [rendezvous(k, 9) for k in keys]
    moved = [b for b, a in zip(before, after, strict=True) if a != b]
    assert 0.06 < len(moved) / len(keys) < 0.17  # 1/9 = 0.111
    assert all(a == 8 for b, a in zip(before, after, strict=True) if a != b)
    assert set(before) == set(range(8))


def test_session_hash_over_a_partial_view_moves_only_the_missing_instance_s_keys() -> None:
    policy = make_policy("session_hash")
    keys = [f"session-{i}" for i in range(600)]
    full = [policy.route(follow_up(key=k), view([0] * 6, [0] * 6)).instance for k in keys]
    # Instance 2 left the view: positions 0..4 now hold instances 0, 1, 3, 4, 5.
    ids = [0, 1, 3, 4, 5]
    partial = ClusterView([0] * 5, [0.0] * 5, [0.0] * 5, instance_ids=ids)
    after = [ids[policy.route(follow_up(key=k), partial).instance] for k in keys]
    moved = [i for i, (b, a) in enumerate(zip(full, after, strict=True)) if a != b]
    assert moved == [i for i, b in enumerate(full) if b == 2]
    assert 2 not in after


def test_session_hash_is_the_same_in_every_process() -> None:
    # Pinned values: blake2b, unlike hash(), does not change with PYTHONHASHSEED.
    assert [rendezvous(f"k{i}", 16) for i in range(8)] == [5, 1, 10, 12, 7, 11, 9, 14]


def test_make_policy_parses_parameters() -> None:
    policy = make_policy(" smetric : overload = 1.5 , hit_ratio=0.3 ")
    assert isinstance(policy, SMetric)
    assert (policy.name, policy.overload, policy.hit_ratio) == ("smetric", 1.5, 0.3)
    linear = make_policy("linear:lam=0.95")
    assert isinstance(linear, Linear) and linear.lam == 0.95
    default = make_policy("smetric:")
    assert isinstance(default, SMetric) and default.overload == 2.0


def test_make_policy_returns_fresh_objects() -> None:
    first, second = make_policy("least_load"), make_policy("least_load")
    assert first is not second
    idle = view([0] * 3, [0] * 3)
    first.route(FIRST, idle)
    assert second.route(FIRST, idle).instance == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown policy 'nope'; valid policies: smetric, linear, lmetric"),
        ("smetric:lam=1", "no parameter 'lam'; valid: overload, hit_ratio"),
        ("lmetric:x=1", "no parameter 'x'; valid: none"),
        ("smetric:overload", "expected key=value, got 'overload'"),
        ("smetric:overload=2,", "expected key=value, got ''"),
        ("smetric:overload=abc", "overload='abc' is not a number"),
        ("smetric:overload=1,overload=2", "parameter 'overload' given twice"),
        ("smetric:overload=-1", "overload must lie in"),
        ("smetric:hit_ratio=nan", "hit_ratio must lie in"),
        ("linear:lam=1.5", "lam must lie in [0, 1.0]"),
        ("cache_aware:cache_threshold=2", "cache_threshold must lie in"),
    ],
)
def test_make_policy_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make_policy(spec)


def test_registry_covers_every_policy_with_defaults() -> None:
    assert policy_params("smetric") == {"overload": 2.0, "hit_ratio": 0.5}
    assert policy_params("linear") == {"lam": 0.9}
    assert policy_params("cache_aware") == {
        "cache_threshold": 0.5,
        "balance_abs_threshold": 32.0,
        "balance_rel_threshold": 1.0001,
    }
    assert policy_params("lmetric") == {}
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="valid policies"):
        policy_params("nope")


def random_calls(
    seed: int, n: int = 16, count: int = 300
) -> list[tuple[RoutingRequest, ClusterView]]:
    rng = random.Random(seed)
    calls = []
    for _ in range(count):
        est = rng.choice([0, 500, 4000])
        request = RoutingRequest(
            turn=rng.choice([0, 1, 5]),
            prompt_tokens=est + rng.randint(0, 2000),
            est_hit_tokens=est,
            session_key=rng.choice(["", "a", "b", "c"]),
        )
        loads = [float(rng.randint(0, 4)) for _ in range(n)]
        hits = [rng.choice([0, 0, est // 2, est]) for _ in range(n)]
        calls.append((request, view(hits, loads)))
    return calls


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_fresh_policies_fed_the_same_calls_decide_the_same(name: str) -> None:
    calls = random_calls(seed=7)
    first, second = make_policy(name), make_policy(name)
    decisions = [first.route(*call) for call in calls]
    assert decisions == [second.route(*call) for call in calls]
    assert {d.branch for d in decisions} <= set(first.branches)


@given(
    name=st.sampled_from(POLICY_NAMES),
    turn=st.integers(0, 3),
    prompt=st.integers(0, 10_000),
    rows=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 100)), min_size=1, max_size=64),
)
def test_any_view_gets_a_valid_decision(
    name: str, turn: int, prompt: int, rows: list[tuple[int, int]]
) -> None:
    hits, loads = [h for h, _ in rows], [float(load) for _, load in rows]
    policy = make_policy(name)
    request = RoutingRequest(turn, prompt, prompt // 2, session_key=str(prompt))
    instance, branch = policy.route(request, view(hits, loads))
    assert 0 <= instance < len(rows)
    assert branch in policy.branches
