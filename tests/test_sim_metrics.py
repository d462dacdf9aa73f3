"""The paper's metrics on a hand-made set of request records."""

import math

import polars as pl
import pytest

from smetric.metrics.slo import SLOConfig
from smetric.metrics.summary import stickiness, summarize, with_latencies

SLO = SLOConfig(ttft_base_s=1.0, ttft_per_token_s=0.001, tpot_s=0.030)


def records() -> pl.DataFrame:
    # (session, turn, instance, arrival, first token, finish, prompt, output, local, global)
    rows = [
        ("a", 0, 0, 0.0, 0.5, 1.5, 1000, 51, 0, 500),  # ttft 0.5 ok, tpot 20 ms ok
        ("a", 1, 0, 2.0, 4.5, 5.5, 1000, 51, 900, 0),  # ttft 2.5 > 2.0: misses
        ("b", 0, 1, 0.0, 1.0, 4.0, 1000, 51, 0, 0),  # tpot 60 ms: misses
        ("b", 1, 0, 5.0, 5.2, 5.4, 2000, 1, 1000, 500),  # ok (no tpot: 1 token)
        ("b", 2, 1, 6.0, 6.1, None, 2000, 11, 0, 0),  # unfinished at the horizon
    ]
    table = pl.DataFrame(
        {
            "request_id": list(range(len(rows))),
            "session_id": [r[0] for r in rows],
            "agent_id": ["main"] * len(rows),
            "turn": [r[1] for r in rows],
            "parent_id": [None, 0, None, 2, 3],
            "instance": [r[2] for r in rows],
            "branch": ["x"] * len(rows),
            "rejected": [False] * len(rows),
            "arrival_s": [r[3] for r in rows],
            "first_token_s": [r[4] for r in rows],
            "finished_s": [r[5] for r in rows],
            "prompt_tokens": [r[6] for r in rows],
            "output_tokens": [r[7] for r in rows],
            "local_hit_tokens": [r[8] for r in rows],
            "global_hit_tokens": [r[9] for r in rows],
            "preemptions": [0] * len(rows),
        },
        schema_overrides={"finished_s": pl.Float64},
    )
    return with_latencies(table, SLO, horizon_s=10.0)


def test_slo_and_tps_within_slo() -> None:
    table = records()
    assert table["met_slo"].to_list() == [True, False, False, True, False]
    summary = summarize(table, SLO, horizon_s=10.0, instances=2, window_s=5.0)
    # Met: 1000 + 51 and 2000 + 1 tokens over a 10 s horizon.
    assert summary.tps_within_slo == pytest.approx((1051 + 2001) / 10)
    assert summary.tps == pytest.approx((1051 * 3 + 2001) / 10)
    assert summary.requests.unfinished == 1
    assert summary.slo_attainment == pytest.approx(2 / 4)


def test_reuse_split_and_stickiness() -> None:
    table = records()
    summary = summarize(table, SLO, horizon_s=10.0, instances=2, window_s=5.0)
    prompt = 7000
    assert summary.reuse.local == pytest.approx(1900 / prompt)
    assert summary.reuse.global_ == pytest.approx(1000 / prompt)
    assert summary.reuse.miss == pytest.approx(1 - 2900 / prompt)
    # Session a's follow-up stays on 0; b's two follow-ups: one on 0 (away), one home on 1.
    shares = stickiness(table)
    assert shares.session == shares.agent == pytest.approx(2 / 3)
    # Turn to turn: a1 follows a0 on 0 (same); b1 left b0's 1 for 0, b2 left b1's 0 for 1.
    assert shares.turn == pytest.approx(1 / 3)


def test_stickiness_counts_a_sub_agent_as_its_own_conversation() -> None:
    # Session s: main agent on instance 0 (turns 0, 1), a sub-agent started on 1 and
    # staying there (turns 0, 1, 2).
    table = pl.DataFrame(
        {
            "request_id": [0, 1, 2, 3, 4],
            "session_id": ["s"] * 5,
            "agent_id": ["main", "main", "sub", "sub", "sub"],
            "turn": [0, 1, 0, 1, 2],
            "parent_id": [None, 0, None, 2, 3],
            "instance": [0, 0, 1, 1, 1],
        }
    )
    shares = stickiness(table)
    assert shares.session == pytest.approx(1 / 3)  # only main's follow-up is on 0
    assert shares.agent == shares.turn == 1.0


def test_latency_percentiles_count_completed_requests() -> None:
    summary = summarize(records(), SLO, horizon_s=10.0, instances=2, window_s=5.0)
    # TTFTs of the four completed requests: 0.5, 2.5, 1.0, 0.2 -> median 0.75.
    assert summary.ttft_s.p50 == pytest.approx(0.75)
    # TPOTs of the three with more than one output token: 20, 20, 60 ms.
    assert summary.tpot_s.p50 == pytest.approx(0.020)


def test_imbalance_windows() -> None:
    summary = summarize(records(), SLO, horizon_s=10.0, instances=2, window_s=5.0)
    heat = summary.load_heatmap
    assert len(heat) == 2 and len(heat[0]) == 2
    # Window [0, 5): instance 0 holds request 0 for 1.5 s and 1 for 3 s; instance 1 holds
    # request 2 for 4 s: (1051*1.5 + 1051*3) / 5 vs 1051*4 / 5.
    assert heat[0][0] == pytest.approx(1051 * 4.5 / 5)
    assert heat[1][0] == pytest.approx(1051 * 4 / 5)
    mean = (heat[0][0] + heat[1][0]) / 2
    assert summary.imbalance.series[0] == pytest.approx(heat[0][0] / mean)
    assert not math.isnan(summary.imbalance.mean)


def test_warm_up_leaves_early_arrivals_and_their_time_out() -> None:
    summary = summarize(records(), SLO, horizon_s=10.0, instances=2, window_s=5.0, warmup_s=1.0)
    # Arrivals at 0 are left out: of a1 (missed) and b1 (met), b1's 2001 tokens over 9 s.
    assert summary.tps_within_slo == pytest.approx(2001 / 9)
    assert summary.requests.completed == 2
    assert summary.requests.unfinished == 1
    with pytest.raises(ValueError, match="warm-up"):
        summarize(records(), SLO, horizon_s=10.0, instances=2, window_s=5.0, warmup_s=10.0)
