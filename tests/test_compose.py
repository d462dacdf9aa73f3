"""Workload composition: seeded session starts, copy-private block ids, closed-loop issue."""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
import polars as pl
import pytest

from smetric.trace.compose import (
    BlockIds,
    ClosedLoopIssuer,
    Workload,
    compose_sessions,
    draw_sessions,
    open_loop_issue_times,
    replay_arrivals,
)
from smetric.trace.schema import Trace, common_prefix_len, finalize

SHARED = [1000, 1001]


def make_trace(rows: list[dict[str, Any]], *, has_clock: bool = False) -> Trace:
    return Trace(
        requests=finalize(pl.DataFrame(rows)),
        name="toy",
        source_format="test",
        has_clock=has_clock,
    )


def request(
    session: str,
    *,
    parent: int | None = None,
    out: int = 10,
    blocks: list[int] | None = None,
    think: float | None = None,
    session_time: float | None = 0.0,
    agent: str = "main",
    framework: str = "fw",
    shared: int = 2,
    arrival: float | None = None,
) -> dict[str, Any]:
    return {
        "session_id": session,
        "agent_id": agent,
        "parent_id": parent,
        "input_tokens": 64 * len(blocks or []),
        "output_tokens": out,
        "block_ids": blocks or [],
        "think_time_s": think,
        "session_time_s": session_time,
        "framework": framework,
        "shared_prefix_blocks": shared,
        "arrival_s": arrival,
    }


def agent_session() -> list[dict[str, Any]]:
    """One session: two main turns, then a sub-agent and a main turn both waiting on
    row 1, plus a parentless sub-agent root that starts 1.5 s into the session."""
    return [
        request("s1", out=100, blocks=[*SHARED, 1, 2]),
        request("s1", parent=0, out=50, think=2.0, blocks=[*SHARED, 1, 2, 3]),
        request("s1", parent=1, out=20, think=0.5, agent="a1", blocks=[*SHARED, 4]),
        request("s1", parent=1, out=40, think=1.0, blocks=[*SHARED, 1, 2, 3, 5]),
        request("s1", out=10, session_time=1.5, agent="a2", blocks=[*SHARED, 6]),
    ]


def many_sessions(count: int) -> Trace:
    """``count`` two-request sessions with private ids 10*s + {0, 1}; the last one uses
    another framework whose shared prefix is the single block 2000."""
    rows = []
    for s in range(count):
        last = s == count - 1
        prefix, framework = ([2000], "other") if last else (SHARED, "fw")
        private = [10 * s, 10 * s + 1]
        rows.append(
            request(f"s{s}", blocks=[*prefix, private[0]], framework=framework, shared=len(prefix))
        )
        rows.append(
            request(
                f"s{s}",
                parent=2 * s,
                think=1.0,
                blocks=[*prefix, *private],
                framework=framework,
                shared=len(prefix),
            )
        )
    return make_trace(rows)


def copy_starts(workload: Workload) -> pl.DataFrame:
    """One row per session copy, in start order."""
    return workload.requests.group_by("session_id", maintain_order=True).agg(
        pl.col("session_start_s").first(), pl.col("source_request_id").first()
    )


def test_same_seed_same_workload_and_other_seed_differs() -> None:
    trace = many_sessions(6)
    a = compose_sessions(trace, rate=2.0, num_sessions=10, seed=7)
    b = compose_sessions(trace, rate=2.0, num_sessions=10, seed=7)
    c = compose_sessions(trace, rate=2.0, num_sessions=10, seed=8)
    assert a.requests.equals(b.requests)
    assert not np.array_equal(
        a.requests["session_start_s"].to_numpy(), c.requests["session_start_s"].to_numpy()
    )
    assert (a.closed_loop, a.seed, a.rate) == (True, 7, 2.0)


def test_poisson_gaps_have_mean_one_over_rate() -> None:
    trace = many_sessions(3)
    starts = copy_starts(compose_sessions(trace, rate=4.0, num_sessions=20_000, seed=1))
    gaps = np.diff(starts["session_start_s"].to_numpy())
    assert starts["session_start_s"][0] == 0.0
    # Standard error of the mean is 0.25 / sqrt(20000) ~ 0.0018; allow over 5 of them.
    assert gaps.mean() == pytest.approx(0.25, abs=0.01)
    # Exponential gaps: the spread equals the mean (a constant-gap process has none).
    assert gaps.std() == pytest.approx(0.25, rel=0.1)


def test_uniform_starts_and_duration_bound() -> None:
    trace = many_sessions(3)
    workload = compose_sessions(trace, rate=2.0, duration_s=5.0, arrival="uniform")
    starts = copy_starts(workload)["session_start_s"].to_list()
    assert starts == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]
    poisson = copy_starts(compose_sessions(trace, rate=50.0, duration_s=10.0, seed=3))
    latest = poisson["session_start_s"].max()
    assert isinstance(latest, float) and latest < 10.0
    assert poisson.height == pytest.approx(500, abs=5 * np.sqrt(500))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 1.0}, "exactly one of duration_s"),
        ({"rate": 1.0, "duration_s": 5.0, "num_sessions": 3}, "exactly one of duration_s"),
        ({"rate": 0.0, "num_sessions": 3}, "rate must be > 0"),
        ({"rate": 1.0, "num_sessions": 3, "arrival": "bursty"}, "arrival must be one of"),
        ({"rate": 1.0, "num_sessions": 0}, "num_sessions must be >= 1"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compose_sessions(many_sessions(2), **kwargs)


def test_sampling_without_then_with_replacement() -> None:
    rng = np.random.default_rng(0)
    few = draw_sessions(rng, available=5, needed=3)
    assert len(set(few.tolist())) == 3
    many = draw_sessions(rng, available=5, needed=12)
    assert sorted(many[:5].tolist()) == [0, 1, 2, 3, 4]
    assert set(many[5:].tolist()) <= {0, 1, 2, 3, 4}

    trace = many_sessions(5)
    distinct = copy_starts(compose_sessions(trace, rate=1.0, num_sessions=4, seed=2))
    assert distinct["session_id"].str.ends_with("#0").all()
    assert distinct["source_request_id"].n_unique() == 4

    repeated = copy_starts(compose_sessions(trace, rate=1.0, num_sessions=12, seed=2))
    assert repeated["source_request_id"][:5].n_unique() == 5
    assert repeated["session_id"][:5].str.ends_with("#0").all()
    assert repeated["session_id"].n_unique() == 12


def test_copies_have_private_blocks_and_shared_prefix() -> None:
    trace = many_sessions(3)
    workload = compose_sessions(trace, rate=1.0, num_sessions=9, seed=4)
    req = workload.requests
    original = trace.requests["block_ids"].to_list()
    private: dict[str, set[int]] = {}
    for session, blocks, keep, source, framework in req.select(
        "session_id", "block_ids", "shared_prefix_blocks", "source_request_id", "framework"
    ).iter_rows():
        assert blocks[:keep] == original[source][:keep]
        assert blocks[:keep] == (SHARED if framework == "fw" else [2000])
        assert len(blocks) == len(original[source])
        private.setdefault(session, set()).update(blocks[keep:])
    sets = list(private.values())
    for i, a in enumerate(sets):
        for b in sets[i + 1 :]:
            assert not a & b
    # Copy 0 keeps the trace's ids; later copies move.
    for session, blocks, source in req.select(
        "session_id", "block_ids", "source_request_id"
    ).iter_rows():
        assert (blocks == original[source]) == session.endswith("#0")


def test_rows_ordered_by_copy_then_original_order_with_parents_remapped() -> None:
    # Sessions interleaved in the trace: rows of s1 and s2 alternate.
    rows = [
        request("s1", blocks=[*SHARED, 1]),
        request("s2", blocks=[*SHARED, 2]),
        request("s1", parent=0, think=1.0, blocks=[*SHARED, 1, 3]),
        request("s2", parent=1, think=1.0, blocks=[*SHARED, 2, 4]),
    ]
    trace = make_trace(rows)
    req = compose_sessions(trace, rate=1.0, num_sessions=4, seed=0, arrival="uniform").requests
    assert req["request_id"].to_list() == list(range(8))
    assert req["session_start_s"].to_list() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    source = req["source_request_id"].to_numpy()
    assert all(source[0::2] < source[1::2])
    # Each child points at its own copy's root, which maps back to the trace's parent.
    assert req["parent_id"].to_list() == [None, 0, None, 2, None, 4, None, 6]
    original_parent = trace.requests["parent_id"].to_numpy()
    assert (source[req["parent_id"][1::2].to_numpy()] == original_parent[source[1::2]]).all()
    assert req["arrival_s"].null_count() == req.height


def drive(workload: Workload, service_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A tiny event loop: each request runs ``service_s`` from its issue, no queueing."""
    issuer = ClosedLoopIssuer(workload)
    issue = np.full(workload.num_requests, np.nan)
    finish = np.full(workload.num_requests, np.nan)
    events: list[tuple[float, int, int]] = []  # (time, 0 issue / 1 complete, request)
    for t, rid in issuer.initial():
        heapq.heappush(events, (t, 0, rid))
    while events:
        t, kind, rid = heapq.heappop(events)
        if kind == 0:
            issue[rid] = t
            heapq.heappush(events, (t + service_s[rid], 1, rid))
        else:
            finish[rid] = t
            for child_t, child in issuer.complete(rid, t):
                heapq.heappush(events, (child_t, 0, child))
    assert issuer.done
    return issue, finish


def test_closed_loop_issue_times_by_hand() -> None:
    trace = make_trace(agent_session())
    workload = compose_sessions(trace, rate=0.5, num_sessions=2, arrival="uniform")
    service = workload.requests["output_tokens"].to_numpy() * 0.01
    issue, finish = drive(workload, service)
    # Copy 0 starts at 0: row 0 runs 0-1; row 1 at 1+2.0=3 runs to 3.5; rows 2 and 3
    # wait on row 1: 3.5+0.5=4.0 and 3.5+1.0=4.5; row 4 is a root at 0+1.5.
    # Copy 1 is the same shifted by its start, 2 s.
    expected = [0.0, 3.0, 4.0, 4.5, 1.5]
    assert issue.tolist() == pytest.approx(expected + [t + 2.0 for t in expected])
    parent = workload.requests["parent_id"].to_numpy()
    children = np.flatnonzero(~np.isnan(parent))
    parents = parent[children].astype(np.int64)
    think = workload.requests["think_time_s"].fill_null(0.0).to_numpy()[children]
    assert (issue[children] >= finish[parents]).all()
    assert issue[children] == pytest.approx(finish[parents] + think)


def test_issuer_orders_ties_and_rejects_misuse() -> None:
    trace = make_trace(agent_session())
    workload = compose_sessions(trace, rate=1.0, num_sessions=1)
    assert workload.roots().tolist() == [0, 4]
    issuer = ClosedLoopIssuer(workload)
    assert issuer.initial() == [(0.0, 0), (1.5, 4)]
    with pytest.raises(ValueError, match="before it was issued"):
        issuer.complete(1, 5.0)
    with pytest.raises(ValueError, match="before its issue"):
        issuer.complete(4, 1.0)
    assert issuer.complete(0, 1.0) == [(3.0, 1)]
    with pytest.raises(ValueError, match="completed twice"):
        issuer.complete(0, 1.0)
    # Two children released at once come back in time order.
    assert issuer.complete(1, 3.5) == [(4.0, 2), (4.5, 3)]
    assert not issuer.done


def clocked_trace() -> Trace:
    rows = [
        request("a", arrival=0.0, blocks=[*SHARED, 1]),
        request("b", arrival=4.0, blocks=[*SHARED, 2]),
        request("a", parent=0, arrival=6.0, blocks=[*SHARED, 1, 3]),
        request("b", parent=1, arrival=5.0, blocks=[*SHARED, 2, 4]),
    ]
    return make_trace(rows, has_clock=True)


def test_replay_rejects_clockless_trace() -> None:
    with pytest.raises(ValueError, match="no global clock"):
        replay_arrivals(many_sessions(2))


def test_replay_scales_and_cuts_the_clock() -> None:
    workload = replay_arrivals(clocked_trace(), speed=2.0)
    req = workload.requests
    assert not workload.closed_loop
    assert req["arrival_s"].to_list() == [0.0, 2.0, 2.5, 3.0]
    assert req["source_request_id"].to_list() == [0, 1, 3, 2]
    assert req["parent_id"].to_list() == [None, None, 1, 0]
    assert req["session_start_s"].to_list() == [0.0, 2.0, 2.0, 0.0]
    assert open_loop_issue_times(workload).tolist() == [0.0, 2.0, 2.5, 3.0]

    cut = replay_arrivals(clocked_trace(), speed=2.0, limit_s=2.5).requests
    assert cut["source_request_id"].to_list() == [0, 1]

    with pytest.raises(ValueError, match="ClosedLoopIssuer"):
        open_loop_issue_times(compose_sessions(many_sessions(2), rate=1.0, num_sessions=1))
    with pytest.raises(ValueError, match="open-loop"):
        ClosedLoopIssuer(workload)


def test_common_prefix_of_a_copy_without_making_its_ids() -> None:
    # Row 1 counts one more block as shared than its parent, row 2 as many: the shortcut
    # must agree with comparing the copies' own ids either way, copy 0 included.
    rows = [
        request("s", blocks=[*SHARED, 5, 6, 7], shared=2),
        request("s", parent=0, blocks=[*SHARED, 5, 6, 7, 8], shared=3),
        request("s", parent=0, blocks=[*SHARED, 5, 9], shared=2),
    ]
    blocks = BlockIds.of(make_trace(rows))
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        for copy in range(3):
            own = common_prefix_len(blocks.of_row(a, copy), blocks.of_row(b, copy))
            assert blocks.common_prefix(a, b, copy) == own
    assert blocks.common_prefix(0, 1, 0) == 5
    assert blocks.common_prefix(0, 1, 1) == 2  # block 5 is shared in one, private in the other
    with pytest.raises(ValueError, match="overflow int64"):
        blocks.check_copies(2**62)
