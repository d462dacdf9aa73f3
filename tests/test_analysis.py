"""Each finding of `smetric analyze` on small traces whose answers were worked out by hand."""

import numpy as np
import pytest

from smetric.trace.analysis import AnalysisOptions, analyze, execution_times
from smetric.trace.analysis.balance import balance_potential
from smetric.trace.analysis.reuse import ideal_reuse, interval_summary
from smetric.trace.analysis.usage import gini, session_usage, trigger_breakdown

from conftest import make_trace


def row(session, turn, parent, blocks, tokens, t, **extra):
    return {
        "session_id": session,
        "turn": turn,
        "parent_id": parent,
        "block_ids": blocks,
        "input_tokens": tokens,
        "output_tokens": 4,
        "session_time_s": t,
        "duration_s": 1.0,
        "block_size": 16,
        **extra,
    }


@pytest.fixture
def three_sessions():
    # A opens with [1,2,3] and grows; B and C open with A's prefix (a shared template);
    # C also reaches block 4, which A wrote in a follow-up (inter-session reuse); C's last
    # request ends in a partial block (75 tokens = 4 full blocks + 11).
    return make_trace(
        [
            row("A", 0, None, [1, 2, 3], 48, 0.0),
            row("A", 1, 0, [1, 2, 3, 4, 5], 80, 3.0),
            row("B", 0, None, [1, 2, 9], 48, 0.0),
            row("B", 1, 2, [1, 2, 9, 10], 64, 2.0),
            row("C", 0, None, [1, 2, 3, 4, 7], 80, 0.0),
            row("C", 1, 4, [1, 2, 3, 4, 7], 75, 5.0),
        ]
    )


def replay(trace):
    t = trace.requests["session_time_s"].to_numpy()
    return ideal_reuse(trace, t, t + 1.0)


def test_ideal_reuse_ratio_and_split(three_sessions):
    totals = replay(three_sessions).totals
    # Hits: A1 48; B0 32; B1 48; C0 64; C1 75 (the partial last block counts 11 tokens).
    assert totals.prompt_tokens == 48 + 80 + 48 + 64 + 80 + 75
    assert totals.hit_tokens == 48 + 32 + 48 + 64 + 75
    # Intra: A1 all 48; B1's block 9 (16); C1's block 7 (11 tokens).
    assert totals.intra_session_tokens == 48 + 16 + 11
    # System prompt: blocks A wrote in its opening request, hit by B0, B1, C0, C1.
    assert totals.system_prompt_tokens == 32 + 32 + 48 + 48
    # Inter-session: block 4, written by A's follow-up, hit by C0 and C1.
    assert totals.inter_session_tokens == 16 + 16
    shares = totals.shares(measurable=True)
    assert shares.ratio == pytest.approx(267 / 395)
    split = shares.breakdown
    assert split.intra_session + split.inter_session + split.system_prompt == pytest.approx(1.0)
    assert shares.cross_session_share == pytest.approx((32 + 160) / 267)


def test_reuse_intervals_without_clock_stay_within_sessions(three_sessions):
    reuse = replay(three_sessions)
    # A1 reuses A0's blocks 2 s after A0 completed (3 blocks); B1 reuses B0's after 1 s
    # (3 blocks); C1 reuses C0's after 4 s (5 blocks). Cross-session sources are skipped.
    pairs = sorted(zip(reuse.interval_s.tolist(), reuse.interval_blocks.tolist(), strict=True))
    assert pairs == [(1.0, 3), (2.0, 3), (4.0, 5)]
    summary = interval_summary(reuse, "session")
    assert summary is not None
    assert summary.count == 11
    assert summary.percentiles.p50 == 2.0
    assert summary.percentiles.p90 == 4.0
    assert summary.within["10"] == 1.0
    assert summary.cdf.y[-1] == pytest.approx(1.0)


def test_reuse_intervals_with_a_clock_cross_sessions():
    trace = make_trace(
        [
            row("A", 0, None, [1, 2], 32, 0.0, arrival_s=0.0),
            row("B", 0, None, [1, 2, 3], 48, 0.0, arrival_s=10.0),
        ],
        has_clock=True,
    )
    t = trace.requests["arrival_s"].to_numpy()
    reuse = ideal_reuse(trace, t, t + 1.0)
    assert reuse.interval_s.tolist() == [9.0]
    assert reuse.interval_blocks.tolist() == [2]


def test_trigger_breakdown():
    trace = make_trace(
        [
            row("A", 0, None, [], 10, 0.0, trigger="user"),
            row("A", 1, 0, [], 20, 1.0, trigger="agent"),
            row("A", 2, 1, [], 30, 2.0, trigger="agent"),
            row("A", 3, 2, [], 40, 3.0, trigger="compaction"),
        ]
    )
    result = trigger_breakdown(trace.requests)
    assert result.requests == {"user": 1, "agent": 2, "compaction": 1, "unknown": 0}
    assert result.tokens == {"user": 14, "agent": 58, "compaction": 44, "unknown": 0}


def test_session_usage_skew():
    trace = make_trace(
        [
            row("A", 0, None, [], 6, 0.0),
            row("B", 0, None, [], 6, 0.0),
            row("C", 0, None, [], 36, 0.0),
            row("C", 1, 2, [], 36, 1.0),
        ]
    )
    usage = session_usage(trace.requests)
    # Per session (input + 4 output): A 10, B 10, C 80.
    assert usage.per_session_tokens == [80, 10, 10]
    assert usage.top_share.top_1 == pytest.approx(0.8)
    assert usage.gini == pytest.approx(2 * (10 + 20 + 240) / 300 - 4 / 3)
    assert usage.lorenz.y[0] == 0.0
    assert usage.lorenz.y[-1] == pytest.approx(1.0)
    assert gini(np.array([5, 5, 5])) == pytest.approx(0.0)


def test_balance_potential_least_tokens_dispatch():
    # Three requests at t=0 on two instances: 100 -> i0, 50 -> i1, 30 -> i1 (50 < 100).
    # A fourth at t=15, when all are done, goes to i0 for 5 s.
    arrivals = np.array([0.0, 0.0, 0.0, 15.0])
    durations = np.array([10.0, 10.0, 10.0, 5.0])
    tokens = np.array([100, 50, 30, 10])
    result = balance_potential(arrivals, durations, tokens, instances=2, window_s=10.0)
    assert result.heatmap == [[100.0, 5.0], [80.0, 0.0]]
    assert result.imbalance.series == pytest.approx([100 / 90, 2.0])
    assert result.requests_per_min_per_instance.series == [9.0, 3.0]


def test_execution_times_fill_missing_with_estimate():
    trace = make_trace(
        [
            row("A", 0, None, [], 20_000, 0.0),
            row("A", 1, 0, [], 10_000, 1.0, duration_s=None),
        ]
    )
    durations, estimated = execution_times(trace.requests)
    assert estimated == 1
    assert durations[0] == 1.0
    assert durations[1] == pytest.approx(10_000 / 10_000 + 4 / 30)


def test_analyze_lays_out_clockless_sessions_deterministically(three_sessions):
    options = AnalysisOptions(instances=2, window_s=10.0, session_rate=1.0, layout_s=30.0)
    first = analyze(three_sessions, options)
    assert first == analyze(three_sessions, options)
    assert first.balance.arrivals == "composed"
    assert first.reuse.ratio == pytest.approx(267 / 395)
    assert len(first.balance.imbalance.series) == 3
    other = analyze(three_sessions, AnalysisOptions(**{**vars(options), "seed": 1}))
    assert other.balance != first.balance


def test_balance_headline_leaves_out_the_ramp_up():
    # One request alone first (all on one of four instances: imbalance 4x), then a steady
    # stream that fills all four evenly.
    arrivals = np.array([0.0] + [10.0 + i for i in range(40)])
    durations = np.array([10.0] + [4.0] * 40)
    tokens = np.array([100] + [100] * 40)
    result = balance_potential(arrivals, durations, tokens, instances=4, window_s=10.0)
    assert result.ramp_up_windows == 1
    assert result.imbalance.max < 4.0
    assert len(result.imbalance.series) == len(result.heatmap[0]) - 1
