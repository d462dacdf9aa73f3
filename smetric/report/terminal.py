"""Terminal summary of the workload findings, plus the wording every report shares.

The number formats, section titles and one-line findings live here so that the terminal
summary and the HTML report state each finding with exactly the same words and digits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import msgspec
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from smetric.report import tables
from smetric.trace.analysis.results import (
    Analysis,
    Balance,
    ReuseIntervals,
    ReuseShares,
    SessionUsage,
    TraceFacts,
    Triggers,
)

TITLES = {
    "reuse": "Figure 5 · Ideal KV-cache reuse",
    "reuse_intervals": "Figure 6 · KV-cache reuse interval",
    "triggers": "Figure 7 · What triggers requests",
    "session_usage": "Figure 8 · Token usage per session",
    "balance": "Figure 9 · Balance potential",
}
TRIGGER_SOURCES = {
    "user": "the user",
    "agent": "the agent",
    "compaction": "context compaction",
    "unknown": "an unrecorded source",
}
REUSE_SOURCES = {
    "intra_session": "Intra-session",
    "inter_session": "Inter-session",
    "system_prompt": "System prompt",
}
NOT_MEASURABLE = "Not measurable: the trace carries no KV-cache block ids."


def pct(share: float) -> str:
    """Format a 0..1 share as a percentage with one decimal, the precision the paper quotes."""
    return f"{share:.1%}"


def seconds(value: float) -> str:
    """Format a duration in the largest unit that keeps it readable (reuse spans ms to hours)."""
    if value < 0.001:
        return f"{value * 1000:.2g} ms"  # sub-millisecond decode steps of fast engines
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 100:
        return f"{value:.1f} s"
    if value < 3600:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def count(value: float) -> str:
    return f"{value:,.0f}"


def times(value: float) -> str:
    """Format a max/mean load ratio."""
    return f"{value:.2f}x"


def shares(counts: Mapping[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {key: value / total if total else 0.0 for key, value in counts.items()}


def _reuse_finding(reuse: ReuseShares) -> str:
    if not reuse.measurable:
        return NOT_MEASURABLE
    return (
        f"An ideal infinite KV store skips {pct(reuse.ratio)} of prompt tokens; "
        f"{pct(reuse.breakdown.intra_session)} of that reuse comes from earlier turns of "
        "the same session."
    )


def _intervals_finding(intervals: ReuseIntervals) -> str:
    p = intervals.percentiles
    return (
        f"Half of all reuses happen within {seconds(p.p50)} of the previous request "
        f"completing and 90% within {seconds(p.p90)}; "
        f"{pct(intervals.within['100'])} happen within 100 s."
    )


def _triggers_finding(triggers: Triggers) -> str:
    requests = shares(triggers.requests)
    tokens = shares(triggers.tokens)
    top = max(requests, key=requests.__getitem__)
    return (
        f"{pct(requests[top])} of requests ({pct(tokens[top])} of tokens) "
        f"are triggered by {TRIGGER_SOURCES[top]}."
    )


def _usage_finding(usage: SessionUsage) -> str:
    return (
        f"Token usage is skewed: the top 10% of sessions use {pct(usage.top_share.top_10)} "
        f"of all tokens (Gini {usage.gini:.2f})."
    )


def _balance_finding(balance: Balance) -> str:
    imbalance = balance.imbalance
    rate = balance.requests_per_min_per_instance.mean
    ramp = balance.ramp_up_windows
    after = (
        f" once the load has ramped up (the first {ramp} window"
        f"{'s' if ramp != 1 else ''}, below half the median load, left out)"
        if ramp
        else ""
    )
    return (
        f"Least-in-flight-tokens dispatch over {balance.instances} instances keeps the "
        f"per-window imbalance (max/mean) at a median of {times(imbalance.p50)} and at most "
        f"{times(imbalance.max)}{after}, with {rate:.1f} requests per minute per instance."
    )


def trace_facts(trace: TraceFacts) -> list[tuple[str, str]]:
    """Describe the trace and how much of it was recorded rather than inferred."""
    return [
        ("Format", trace.format),
        ("Requests", count(trace.requests)),
        (
            "Sessions",
            count(trace.sessions) + (" (inferred)" if trace.sessions_inferred else ""),
        ),
        ("Clock", "recorded" if trace.has_clock else "none"),
        ("Block size", "n/a" if trace.block_size is None else f"{trace.block_size} tokens"),
        ("Skipped records", count(sum(trace.skipped.values()))),
    ]


def _kv_table(name: str, rows: Sequence[tuple[str, str]]) -> tables.Table:
    columns = (tables.Column("metric", "left"), tables.Column("value"))
    values = tuple({"metric": label, "value": value} for label, value in rows)
    return tables.Table(name, TITLES[name], columns, tuple(rows), values)


def _reuse_rows(reuse: ReuseShares) -> list[tuple[str, str]]:
    split = msgspec.structs.asdict(reuse.breakdown)
    rows = [("Ideal reuse ratio", f"{pct(reuse.ratio)} of {count(reuse.prompt_tokens)} tokens")]
    rows += [(REUSE_SOURCES[key], f"{pct(split[key])} of hits") for key in REUSE_SOURCES]
    if reuse.cross_session_share is not None:
        rows.append(("From other sessions", f"{pct(reuse.cross_session_share)} of hits"))
    return rows


def _intervals_rows(intervals: ReuseIntervals) -> list[tuple[str, str]]:
    p = intervals.percentiles
    within = intervals.within
    return [
        ("Reuses", f"{count(intervals.count)} ({intervals.clock} clock)"),
        ("p50 / p90 / p99", " / ".join(seconds(v) for v in (p.p50, p.p90, p.p99))),
        (
            "Within 10 s / 100 s / 1000 s",
            " / ".join(pct(within[key]) for key in ("10", "100", "1000")),
        ),
    ]


def _usage_rows(usage: SessionUsage) -> list[tuple[str, str]]:
    top = usage.top_share
    return [
        ("Sessions", count(usage.sessions)),
        ("Mean / p50 tokens", f"{count(usage.mean)} / {count(usage.p50)}"),
        ("p90 / p99 / max tokens", " / ".join(count(v) for v in (usage.p90, usage.p99, usage.max))),
        (
            "Top 1% / 10% / 20% share",
            " / ".join(pct(v) for v in (top.top_1, top.top_10, top.top_20)),
        ),
        ("Gini", f"{usage.gini:.2f}"),
    ]


def _balance_rows(balance: Balance) -> list[tuple[str, str]]:
    rate = balance.requests_per_min_per_instance
    imbalance = balance.imbalance
    return [
        ("Instances / window", f"{balance.instances} / {seconds(balance.window_s)}"),
        ("Arrivals / durations", f"{balance.arrivals} / {balance.durations}"),
        ("Requests/min/instance", f"{rate.mean:.1f} (min {rate.min:.1f}, max {rate.max:.1f})"),
        ("Imbalance mean / p50", f"{times(imbalance.mean)} / {times(imbalance.p50)}"),
        ("Imbalance p90 / max", f"{times(imbalance.p90)} / {times(imbalance.max)}"),
    ]


def _triggers_table(triggers: Triggers) -> tables.Table:
    columns = (
        tables.Column("trigger", "left"),
        *(tables.Column(h) for h in ("requests", "share", "tokens", "token share")),
    )
    requests, tokens = shares(triggers.requests), shares(triggers.tokens)
    rows, values = [], []
    for key in TRIGGER_SOURCES:
        rows.append(
            (
                key,
                count(triggers.requests[key]),
                pct(requests[key]),
                count(triggers.tokens[key]),
                pct(tokens[key]),
            )
        )
        values.append(
            {
                "trigger": key,
                "requests": triggers.requests[key],
                "share": requests[key],
                "tokens": triggers.tokens[key],
                "token_share": tokens[key],
            }
        )
    return tables.Table("triggers", TITLES["triggers"], columns, tuple(rows), tuple(values))


class Finding(NamedTuple):
    """A section of the study as every report states it: its one-sentence finding with
    the headline number, and its numbers as a table (None where the trace cannot measure
    them)."""

    name: str
    title: str
    sentence: str
    table: tables.Table | None


def findings(result: Analysis) -> list[Finding]:
    """Every present section's finding, in the report's order."""
    found: list[tuple[str, str, tables.Table | None]] = []
    reuse = result.reuse
    rows = _kv_table("reuse", _reuse_rows(reuse)) if reuse.measurable else None
    found.append(("reuse", _reuse_finding(reuse), rows))
    if (intervals := result.reuse_intervals) is not None:
        table = _kv_table("reuse_intervals", _intervals_rows(intervals))
        found.append(("reuse_intervals", _intervals_finding(intervals), table))
    found.append(("triggers", _triggers_finding(result.triggers), _triggers_table(result.triggers)))
    usage = result.session_usage
    found.append(
        ("session_usage", _usage_finding(usage), _kv_table("session_usage", _usage_rows(usage)))
    )
    balance = result.balance
    found.append(
        ("balance", _balance_finding(balance), _kv_table("balance", _balance_rows(balance)))
    )
    return [Finding(name, TITLES[name], sentence, table) for name, sentence, table in found]


def section_tables(result: Analysis) -> list[tables.Table]:
    """Every finding's table, in the report's order."""
    return [f.table for f in findings(result) if f.table is not None]


def render_summary(result: Analysis, console: Console) -> None:
    """Print the trace header, then per finding its sentence and a compact table of numbers."""
    trace = result.trace
    facts = Table.grid(padding=(0, 2))
    for label, value in trace_facts(trace):
        facts.add_row(Text(label, style="bold"), Text(value))
    notes = [Text(f"• {note}", style="yellow") for note in trace.notes]
    title = Text(f"Trace {trace.name}")
    console.print(Panel(Group(facts, *notes), title=title, title_align="left", expand=False))
    for found in findings(result):
        console.print()
        console.rule(Text(found.title, style="bold cyan"), align="left")
        console.print(Text(found.sentence, style="italic"))
        if found.table is not None:
            tables.print_table(dataclasses.replace(found.table, title=""), console)
