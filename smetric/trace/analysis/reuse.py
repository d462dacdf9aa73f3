"""Ideal KV reuse with an infinite store, where it comes from, and how soon it happens.

The paper's Figures 5 and 6. Requests are replayed in issue order against a store that
never evicts: a request hits the longest run of leading blocks already stored. Each hit
block is attributed to the session that first produced it (the paper's "which session
originally produced the reused tokens"):

* intra-session: this request's own session produced it;
* system-prompt: another session produced it in that session's opening request, i.e. the
  shared prompt template that a fresh session starts with;
* inter-session: any other session's block (forked agents sharing a parent's context).

The reuse interval of a hit block is the time from the completion of the last request
that used it to this request's issue: how long the block must survive in a cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from smetric.trace.analysis.results import (
    Clock,
    Curve,
    IntervalPercentiles,
    ReuseBreakdown,
    ReuseIntervals,
    ReuseShares,
)
from smetric.trace.schema import Trace

INTERVAL_MARKS_S = (10, 100, 1000)
CDF_POINTS = 200
PROGRESS_EVERY = 1024


@dataclass(frozen=True)
class ReuseTotals:
    prompt_tokens: int
    hit_tokens: int
    intra_session_tokens: int
    inter_session_tokens: int
    system_prompt_tokens: int

    def shares(self, measurable: bool) -> ReuseShares:
        hit = self.hit_tokens

        def share(tokens: int) -> float:
            return tokens / hit if hit else 0.0

        return ReuseShares(
            prompt_tokens=self.prompt_tokens,
            hit_tokens=hit,
            ratio=hit / self.prompt_tokens if self.prompt_tokens else 0.0,
            intra_session_tokens=self.intra_session_tokens,
            inter_session_tokens=self.inter_session_tokens,
            system_prompt_tokens=self.system_prompt_tokens,
            breakdown=ReuseBreakdown(
                intra_session=share(self.intra_session_tokens),
                inter_session=share(self.inter_session_tokens),
                system_prompt=share(self.system_prompt_tokens),
            ),
            # Hits on blocks another session produced: inter-session and system prompt.
            cross_session_share=share(self.inter_session_tokens + self.system_prompt_tokens),
            measurable=measurable,
        )


@dataclass(frozen=True)
class IdealReuse:
    totals: ReuseTotals
    # Reuse intervals in seconds, each with the number of blocks reused after that gap.
    interval_s: np.ndarray
    interval_blocks: np.ndarray
    # Per-request hit tokens, for later findings (e.g. tokens left to compute).
    hit_tokens: np.ndarray


def dense_block_ids(flat: np.ndarray) -> np.ndarray:
    """Ids as small non-negative ints, so per-block state fits in flat arrays."""
    if len(flat) == 0 or (flat.min() >= 0 and flat.max() < 4 * len(flat) + 1024):
        return flat
    return np.unique(flat, return_inverse=True)[1].astype(np.int64)


def ideal_reuse(
    trace: Trace,
    issue_s: np.ndarray,
    complete_s: np.ndarray,
    progress: Callable[[int], None] | None = None,
) -> IdealReuse:
    """Replay the trace against an infinite prefix store.

    ``issue_s``/``complete_s`` give each request's times on whatever clock the trace has;
    when it has no global clock, intervals are only taken between requests of one session.
    """
    frame = trace.requests
    flat, offsets = trace.block_arrays()
    flat = dense_block_ids(flat)
    session = frame["session_id"].rank("dense").cast(pl.Int64).to_numpy() - 1
    opens_session = (frame["parent_id"].is_null() & (frame["agent_id"] == "main")).to_numpy()
    input_tokens = frame["input_tokens"].to_numpy()
    block_size = frame["block_size"].to_numpy()
    same_clock_only = not trace.has_clock

    num_ids = int(flat.max()) + 1 if len(flat) else 0
    first_user = np.full(num_ids, -1, dtype=np.int64)
    last_user = np.full(num_ids, -1, dtype=np.int64)
    hits = np.zeros(frame.height, dtype=np.int64)
    intra = inter = system = 0
    gaps: list[np.ndarray] = []
    counts: list[np.ndarray] = []

    for r in range(frame.height):
        if progress is not None and r % PROGRESS_EVERY == PROGRESS_EVERY - 1:
            progress(PROGRESS_EVERY)
        ids = flat[offsets[r] : offsets[r + 1]]
        if len(ids) == 0:
            continue
        producers = first_user[ids]
        unseen = producers < 0
        h = int(np.argmax(unseen)) if unseen.any() else len(ids)
        if h:
            bs = int(block_size[r])
            tokens = np.clip(input_tokens[r] - np.arange(h) * bs, 0, bs)
            hits[r] = int(tokens.sum())
            producer_session = session[producers[:h]]
            own = producer_session == session[r]
            template = ~own & opens_session[producers[:h]]
            intra += int(tokens[own].sum())
            system += int(tokens[template].sum())
            inter += int(tokens[~own & ~template].sum())
            sources = last_user[ids[:h]]
            if same_clock_only:
                sources = sources[session[sources] == session[r]]
            source, n = np.unique(sources, return_counts=True)
            gaps.append(issue_s[r] - complete_s[source])
            counts.append(n)
        first_user[ids[unseen]] = r
        last_user[ids] = r

    if progress is not None:
        progress(frame.height % PROGRESS_EVERY)
    totals = ReuseTotals(
        prompt_tokens=int(input_tokens.sum()),
        hit_tokens=int(hits.sum()),
        intra_session_tokens=intra,
        inter_session_tokens=inter,
        system_prompt_tokens=system,
    )
    interval_s = np.concatenate(gaps) if gaps else np.empty(0)
    interval_blocks = np.concatenate(counts) if counts else np.empty(0, dtype=np.int64)
    return IdealReuse(totals, np.maximum(interval_s, 0.0), interval_blocks, hits)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    idx = int(np.searchsorted(cum, q * cum[-1], side="left"))
    return float(values[order][min(idx, len(values) - 1)])


def interval_summary(reuse: IdealReuse, clock: Clock) -> ReuseIntervals | None:
    """Figure 6's data: percentiles, shares within marks and a log-spaced CDF."""
    values, weights = reuse.interval_s, reuse.interval_blocks
    if len(values) == 0:
        return None
    total = float(weights.sum())
    positive = values[values > 0]
    lo = max(float(positive.min()) if len(positive) else 0.1, 1e-3)
    hi = max(float(values.max()), lo * 10)
    grid = np.geomspace(lo, hi, CDF_POINTS)
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order]) / total
    idx = np.searchsorted(values[order], grid, side="right")
    cdf = np.where(idx > 0, cum[np.maximum(idx - 1, 0)], 0.0)
    return ReuseIntervals(
        clock=clock,
        count=int(total),
        percentiles=IntervalPercentiles(
            p50=weighted_quantile(values, weights, 0.5),
            p90=weighted_quantile(values, weights, 0.9),
            p99=weighted_quantile(values, weights, 0.99),
        ),
        within={
            str(mark): float(weights[values <= mark].sum() / total) for mark in INTERVAL_MARKS_S
        },
        cdf=Curve(x=grid.tolist(), y=cdf.tolist()),
    )
