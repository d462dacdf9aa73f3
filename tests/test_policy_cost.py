"""smetric_cost's rule on scenarios small enough to work out by hand.

With ``prefill_tps=1000, attn_tokens=1000`` prefilling tokens ``0..n`` takes
``(n + n**2 / 2000) / 1000`` s: 1.5 s for 1,000 tokens, 1.705 s for 1,100. A follow-up of
1,100 tokens whose first 1,000 are cached on instance 0 therefore costs 0.205 s of
compute there and 1.705 s on an instance holding nothing (a recompute), or 0.205 s plus
the fetch of 1,000 tokens (0.1 s at ``fetch_tps=10000``) where the global tier backs it.
With ``queue_depth=0`` each queued token waits 1 ms, ``output_tokens=0`` leaves the
decode term out unless a case sets it, ``work_weight=1`` counts the work once and
``decode_weight=0`` leaves out the work's charge per request in flight unless a case sets
them.
"""

from __future__ import annotations

import pytest

from smetric.core import Choice, ClusterView, RoutingRequest, make_policy
from smetric.core.policies.smetric_cost import SMetricCost

HAND = (
    "smetric_cost:prefill_tps=1000,attn_tokens=1000,fetch_tps=10000,"
    "queue_depth=0,output_tokens=0,work_weight=1,decode_weight=0"
)
FOLLOW_UP = RoutingRequest(turn=1, prompt_tokens=1100, est_hit_tokens=1000)
FIRST = RoutingRequest(turn=0, prompt_tokens=1100, est_hit_tokens=0)


def view(
    queued: list[float],
    global_hit: int | None,
    hits: list[int] | None = None,
    tokens: list[float] | None = None,
    loads: list[float] | None = None,
) -> ClusterView:
    n = len(queued)
    return ClusterView(
        hit_tokens=[1000] + [0] * (n - 1) if hits is None else hits,
        inflight_requests=[1.0] * n if loads is None else loads,
        unprefilled_tokens=queued,
        inflight_prompt_tokens=[0.0] * n if tokens is None else tokens,
        global_hit_tokens=global_hit,
    )


CASES = [
    # No global tier: moving costs 1.705 - 0.205 = 1.5 s of recompute, so a queue of
    # 1,499 tokens (1.499 s) is not worth leaving and one of 1,501 is.
    (HAND, view([1499, 0, 0], 0), (0, "sticky")),
    (HAND, view([1501, 0, 0], 0), (1, "move_recompute")),
    # The global tier holds the prefix: a move costs the 0.1 s fetch only.
    (HAND, view([99, 0, 0], 1000), (0, "sticky")),
    (HAND, view([101, 0, 0], 1000), (1, "move_fetch")),
    # What the global tier holds is unknown: priced as a recompute, so the same queue stays.
    (HAND, view([101, 0, 0], None), (0, "sticky")),
    (HAND, view([1501, 0, 0], None), (1, "move_recompute")),
    # The global tier holds half the prefix: elsewhere 500 tokens are fetched (0.05 s) and
    # 600 computed from 500 deep (1.705 - 0.625 = 1.08 s), so moving costs 0.925 s.
    (HAND, view([924, 0, 0], 500), (0, "sticky")),
    (HAND, view([926, 0, 0], 500), (1, "move_recompute")),
    # Among the others the cheapest wins: instance 2 holds 400 of the prefix locally and
    # the global tier 1,000, so it fetches only 600 (0.06 s) against instance 1's 0.1 s.
    (HAND, view([500, 0, 0], 1000, hits=[1000, 0, 400]), (2, "move_fetch")),
    # A queue of work 11 k tokens deep waits (1 + 11/1) ms a token: 12 ms x 130 > 1.5 s.
    (
        HAND.replace("queue_depth=0", "queue_depth=11000"),
        view([130, 0, 0], 0),
        (1, "move_recompute"),
    ),
    (HAND.replace("queue_depth=0", "queue_depth=11000"), view([120, 0, 0], 0), (0, "sticky")),
    # Decode: 100 steps reading 10 us per in-flight token, 1 ms per token in all. Instance
    # 0's 2,000 in-flight tokens slow this request by 2 s, more than the 1.5 s recompute.
    (
        HAND.replace("output_tokens=0", "output_tokens=100,kv_read_s=0.00001"),
        view([0, 0, 0], 0, tokens=[2000, 0, 100]),
        (1, "move_recompute"),
    ),
    (
        HAND.replace("output_tokens=0", "output_tokens=100,kv_read_s=0.00001"),
        view([0, 0, 0], 0, tokens=[1400, 0, 100]),
        (0, "sticky"),
    ),
    # Work counted twice (the default): a recompute move must save 2 x 1.5 = 3 s of queue.
    (HAND.replace("work_weight=1", "work_weight=2"), view([2999, 0, 0], 0), (0, "sticky")),
    (HAND.replace("work_weight=1", "work_weight=2"), view([3001, 0, 0], 0), (1, "move_recompute")),
    # Work also counted 0.5 times per request in flight where it runs (``decode_weight``):
    # with one request on each, a recompute costs 1.5 x 1.705 s and staying 1.501 s plus
    # 1.5 x 0.205 s, so the queue that moved the follow-up above no longer does.
    (HAND.replace("decode_weight=0", "decode_weight=0.5"), view([1501, 0, 0], 0), (0, "sticky")),
    # Among the instances it could move to, the one with fewer decodes to slow wins: 1.705 s
    # on the idle instance 2 against 3 x 1.705 s on instance 1, and 3 s + 1.5 x 0.205 s home.
    (
        HAND.replace("decode_weight=0", "decode_weight=0.5"),
        view([3000, 0, 0], 0, loads=[1, 4, 0]),
        (2, "move_recompute"),
    ),
    # History gone from every tier: the least queued instance, as a fresh prompt.
    (HAND, view([300, 200, 100], 0, hits=[0, 0, 0]), (2, "evicted")),
    # A first turn is balanced on in-flight tokens, even against a cache hit and a queue.
    (HAND, view([900, 0, 0], 0, hits=[1000, 0, 0], tokens=[10, 90, 20]), (0, "first_turn_balance")),
]


@pytest.mark.parametrize(("spec", "view_", "expected"), CASES)
def test_the_cost_rule_by_hand(spec: str, view_: ClusterView, expected: tuple[int, str]) -> None:
    policy = make_policy(spec)
    request = FIRST if expected[1] == "first_turn_balance" else FOLLOW_UP
    decision = policy.route(request, view_)
    assert decision == Choice(*expected)
    assert decision.branch in policy.branches


def test_costs_are_the_seconds_worked_out_above() -> None:
    policy = make_policy(HAND)
    assert isinstance(policy, SMetricCost)
    costs = policy.costs(FOLLOW_UP, view([1000, 0, 0], 1000, hits=[1000, 0, 400]))
    assert costs == pytest.approx([1.0 + 0.205, 0.205 + 0.1, 0.205 + 0.06])
    assert policy.prefill_s(1000) == pytest.approx(1.5)


def test_without_token_counts_first_turns_balance_requests_and_decode_is_left_out() -> None:
    policy = make_policy(HAND.replace("output_tokens=0", "output_tokens=100,kv_read_s=1"))
    counts = ClusterView([0, 0, 0], [3.0, 1.0, 2.0], [0.0, 0.0, 0.0])
    assert policy.route(FIRST, counts) == Choice(1, "first_turn_balance")
    # Request counts are not KV: 3 in-flight requests do not push the follow-up away.
    held = ClusterView([1000, 0, 0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    assert policy.route(FOLLOW_UP, held) == Choice(0, "sticky")


def test_equal_costs_stay_on_the_cache_then_rotate() -> None:
    policy = make_policy(HAND)
    # Everything in the global tier and nothing queued: every instance costs the same
    # but the fetch, so the one holding the prefix wins.
    assert policy.route(FOLLOW_UP, view([0, 0, 0], 1000)).branch == "sticky"
    idle = view([0, 0, 0], 0, hits=[0, 0, 0])
    assert [policy.route(FOLLOW_UP, idle).instance for _ in range(4)] == [0, 1, 2, 0]


@pytest.mark.parametrize(
    ("param", "value"),
    [("prefill_tps", "0"), ("attn_tokens", "-1"), ("fetch_tps", "inf"), ("queue_depth", "-1")],
)
def test_parameters_that_divide_or_scale_must_be_sensible(param: str, value: str) -> None:
    with pytest.raises(ValueError, match=param):
        make_policy(f"smetric_cost:{param}={value}")
