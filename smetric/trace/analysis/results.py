"""What ``smetric analyze`` produces, typed: the one schema ``analyze`` writes
(``analysis.json``) and the terminal summary, the plots and the HTML page read.

Fields are named as the file's keys (``TopShares.top_10`` is the file's ``"10%"``), so a
record and its JSON convert both ways without a mapping table. Every field is written,
defaults included, so the file keeps the shape it always had; the fields with defaults
are those older files lack, and such files still load.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from smetric.core.records import JsonRecord

Clock = Literal["global", "session"]
# Arrivals from the trace's clock, or laid out by a Poisson process of sessions.
Arrivals = Literal["recorded", "composed"]
# Execution times as the trace records them, estimated from token counts, or both.
Durations = Literal["recorded", "estimated", "recorded, some estimated"]


class AnalysisRecord(JsonRecord, frozen=True):
    """A section of a trace's analysis. Sections with a default in the middle repeat
    ``kw_only``: type checkers do not inherit it, and the file's key order is kept."""


class TraceFacts(AnalysisRecord, frozen=True, kw_only=True):
    """The trace analysed, and how much of it was recorded rather than inferred."""

    name: str
    format: str
    requests: int
    sessions: int
    has_clock: bool
    sessions_inferred: bool
    # None where requests differ in block size.
    block_size: int | None
    # Records of unknown types left out, per type.
    skipped: dict[str, int] = msgspec.field(default_factory=dict)
    notes: list[str]


class ReuseBreakdown(AnalysisRecord, frozen=True):
    """Shares of the hit tokens by the session that first produced them."""

    intra_session: float
    inter_session: float
    system_prompt: float


class ReuseShares(AnalysisRecord, frozen=True, kw_only=True):
    """Figure 5: ideal reuse with an infinite store, and where it comes from."""

    prompt_tokens: int
    hit_tokens: int
    ratio: float
    intra_session_tokens: int
    inter_session_tokens: int
    system_prompt_tokens: int
    breakdown: ReuseBreakdown
    # Share of hits on blocks another session produced (inter-session and system prompt).
    cross_session_share: float | None = None
    # False where the trace carries no KV-cache block ids.
    measurable: bool


class IntervalPercentiles(AnalysisRecord, frozen=True):
    p50: float
    p90: float
    p99: float


class Curve(AnalysisRecord, frozen=True):
    x: list[float]
    y: list[float]


class ReuseIntervals(AnalysisRecord, frozen=True):
    """Figure 6: how long a reused block waited since its last use, weighted by blocks."""

    clock: Clock
    count: int
    percentiles: IntervalPercentiles
    # Share of reuses within each mark, keyed by the mark in seconds ("10", "100", ...).
    within: dict[str, float]
    cdf: Curve


class Triggers(AnalysisRecord, frozen=True):
    """Figure 7: requests and tokens per trigger (``Trigger``'s values)."""

    requests: dict[str, int]
    tokens: dict[str, int]


class TopShares(AnalysisRecord, frozen=True):
    """Share of all tokens used by the heaviest 1 %, 10 % and 20 % of sessions."""

    top_1: float = msgspec.field(name="1%")
    top_10: float = msgspec.field(name="10%")
    top_20: float = msgspec.field(name="20%")


class SessionUsage(AnalysisRecord, frozen=True):
    """Figure 8: tokens per session and how unevenly they are spread."""

    sessions: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float
    top_share: TopShares
    gini: float
    lorenz: Curve
    # The heaviest sessions' tokens, heaviest first (capped).
    per_session_tokens: list[int]


class RateStats(AnalysisRecord, frozen=True):
    mean: float
    min: float
    max: float
    series: list[float]


class ImbalanceStats(AnalysisRecord, frozen=True):
    mean: float
    p50: float
    p90: float
    max: float
    series: list[float]


class Balance(AnalysisRecord, frozen=True, kw_only=True):
    """Figure 9: per-window imbalance under least-in-flight-tokens dispatch."""

    instances: int
    window_s: float
    # Leading windows left out of the imbalance figures (the heatmap keeps them).
    ramp_up_windows: int = 0
    requests_per_min_per_instance: RateStats
    imbalance: ImbalanceStats
    # Mean in-flight tokens per instance (rows) and window (columns).
    heatmap: list[list[float]]
    arrivals: Arrivals
    durations: Durations


class Analysis(AnalysisRecord, frozen=True):
    """Every finding of the workload study on one trace; a section is None where the
    trace cannot measure it (reuse intervals without block ids)."""

    trace: TraceFacts
    reuse: ReuseShares
    reuse_intervals: ReuseIntervals | None
    triggers: Triggers
    session_usage: SessionUsage
    balance: Balance
