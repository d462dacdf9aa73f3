"""Decode policies: what each picks, and that a share is never compared with a count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from smetric.core.policies import Choice
from smetric.core.policies.decode import DECODE_POLICY_NAMES, DecodeView, make_decode_policy


def test_least_kv_takes_the_least_used_pool() -> None:
    policy = make_decode_policy("least_kv")
    view = DecodeView(inflight_requests=[0, 9, 3], kv_used_fraction=[0.8, 0.1, 0.5])
    assert policy.choose(view) == Choice(1, "least_kv")


def test_least_kv_compares_every_instance_by_requests_when_one_share_is_unknown() -> None:
    """An engine without a fresh scrape must not win (or lose) by comparing its request
    count with the others' KV shares: the whole pool falls back to request counts."""
    policy = make_decode_policy("least_kv")
    view = DecodeView(inflight_requests=[1, 4, 2], kv_used_fraction=[0.3, None, 0.9])
    assert policy.choose(view) == Choice(0, "least_requests_fallback")


def test_least_requests_and_round_robin() -> None:
    view = DecodeView(inflight_requests=[5, 2, 2], kv_used_fraction=[0.0, 0.0, 0.0])
    fewest = make_decode_policy("least_requests")
    assert [fewest.choose(view).instance for _ in range(3)] == [1, 2, 1]
    turns = make_decode_policy("round_robin")
    assert [turns.choose(view).instance for _ in range(4)] == [0, 1, 2, 0]


def test_an_unknown_decode_policy_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="use one of least_kv, least_requests, round_robin"):
        make_decode_policy("nope")


@given(
    name=st.sampled_from(DECODE_POLICY_NAMES),
    rows=st.lists(
        st.tuples(st.integers(0, 50), st.none() | st.floats(0.0, 1.0)), min_size=1, max_size=16
    ),
)
def test_any_view_gets_a_valid_decision(name: str, rows: list[tuple[int, float | None]]) -> None:
    policy = make_decode_policy(name)
    view = DecodeView([n for n, _ in rows], [used for _, used in rows])
    instance, branch = policy.choose(view)
    assert 0 <= instance < len(rows)
    assert branch in policy.branches
