"""The paper's workload study (§3), computed for any loaded trace.

``analyze`` returns one typed record with every figure's data (``results.Analysis``, the
schema of ``analysis.json``); ``smetric.report`` turns it into a terminal summary, PNG
plots and an HTML page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

from smetric.trace.analysis.balance import balance_potential
from smetric.trace.analysis.results import Analysis, Balance, Clock, Durations, TraceFacts
from smetric.trace.analysis.reuse import ideal_reuse, interval_summary
from smetric.trace.analysis.usage import session_usage, trigger_breakdown
from smetric.trace.compose import session_schedule
from smetric.trace.schema import Trace

# Used only where a trace records no execution time (Mooncake, Azure): a busy instance's
# per-request prefill and decode speeds, order-of-magnitude figures for an H20-class GPU.
ESTIMATED_PREFILL_TOK_S = 10_000.0
ESTIMATED_DECODE_TOK_S = 30.0


@dataclass(frozen=True)
class AnalysisOptions:
    instances: int = 32
    window_s: float = 60.0
    # Session arrival rate used to lay out traces that have no global clock.
    session_rate: float = 0.5
    # How long sessions keep starting when laying out a trace without a global clock.
    layout_s: float = 3600.0
    seed: int = 0


def execution_times(requests: pl.DataFrame) -> tuple[np.ndarray, int]:
    """Recorded durations, estimated from token counts where missing; and how many were."""
    recorded = requests["duration_s"].to_numpy()
    missing = np.isnan(recorded.astype(np.float64))
    estimate = (
        requests["input_tokens"].to_numpy() / ESTIMATED_PREFILL_TOK_S
        + requests["output_tokens"].to_numpy() / ESTIMATED_DECODE_TOK_S
    )
    return np.where(missing, estimate, recorded).astype(np.float64), int(missing.sum())


def balance_study(
    trace: Trace, durations: np.ndarray, options: AnalysisOptions, recorded: Durations
) -> tuple[Balance, str | None]:
    """Figure 9 on the trace's own clock, or on sessions laid out by a Poisson process.

    ``recorded`` says how many durations the trace recorded, for the result. A session
    trace without a clock is laid out at ``session_rate`` for ``layout_s``
    (sessions drawn again when the trace runs out, as the composer does); only windows
    within that period count, so the ramp-down after the last start does not.
    """
    requests = trace.requests
    tokens = (requests["input_tokens"] + requests["output_tokens"]).to_numpy()
    if trace.has_clock:
        arrivals = requests["arrival_s"].to_numpy().astype(np.float64)
        result = balance_potential(
            arrivals,
            durations,
            tokens,
            options.instances,
            options.window_s,
            arrivals="recorded",
            durations=recorded,
        )
        return result, None
    rows, starts = session_schedule(
        trace, rate=options.session_rate, duration_s=options.layout_s, seed=options.seed
    )
    arrivals = starts + requests["session_time_s"].to_numpy()[rows]
    result = balance_potential(
        arrivals,
        durations[rows],
        tokens[rows],
        options.instances,
        options.window_s,
        until_s=options.layout_s,
        arrivals="composed",
        durations=recorded,
    )
    note = (
        f"No global clock: for the balance study, sessions start by a Poisson process at "
        f"{options.session_rate:g}/s for {options.layout_s:g} s (seed {options.seed}), "
        f"{len(np.unique(starts))} session starts, {len(rows):,} requests."
    )
    return result, note


def analyze(
    trace: Trace,
    options: AnalysisOptions | None = None,
    progress: Callable[[int], None] | None = None,
) -> Analysis:
    """Every finding of §3; ``progress`` is told how many requests the reuse replay did."""
    options = options or AnalysisOptions()
    requests = trace.requests
    durations, estimated = execution_times(requests)
    clock: Clock = "global" if trace.has_clock else "session"
    issue = (requests["arrival_s"] if trace.has_clock else requests["session_time_s"]).to_numpy()
    issue = np.nan_to_num(issue.astype(np.float64))
    measurable = bool(requests["block_ids"].list.len().sum())
    reuse = ideal_reuse(trace, issue, issue + durations, progress)

    notes = list(trace.notes)
    if trace.skipped:
        notes.append(f"Records of unknown types left out: {trace.skipped_text()}.")
    if estimated:
        notes.append(
            f"{estimated} of {trace.num_requests} requests record no execution time; "
            f"estimated as input/{ESTIMATED_PREFILL_TOK_S:.0f} + "
            f"output/{ESTIMATED_DECODE_TOK_S:.0f} tokens per second."
        )
    recorded: Durations = (
        "recorded"
        if not estimated
        else ("estimated" if estimated == trace.num_requests else "recorded, some estimated")
    )
    balance, layout_note = balance_study(trace, durations, options, recorded)
    if layout_note:
        notes.append(layout_note)

    block_sizes = requests["block_size"].unique().to_list()
    return Analysis(
        trace=TraceFacts(
            name=trace.name,
            format=trace.source_format,
            requests=trace.num_requests,
            sessions=trace.num_sessions,
            has_clock=trace.has_clock,
            sessions_inferred=trace.sessions_inferred,
            block_size=block_sizes[0] if len(block_sizes) == 1 else None,
            skipped=dict(trace.skipped),
            notes=notes,
        ),
        reuse=reuse.totals.shares(measurable),
        reuse_intervals=interval_summary(reuse, clock) if measurable else None,
        triggers=trigger_breakdown(requests),
        session_usage=session_usage(requests),
        balance=balance,
    )
