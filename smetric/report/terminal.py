"""Terminal summary of the workload findings, plus the wording every report shares.

The number formats, section titles and one-line findings live here so that the terminal
summary and the HTML report state each finding with exactly the same words and digits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from smetric.report import tables

Section = Mapping[str, Any]

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


def _reuse_finding(reuse: Section) -> str:
    if not reuse["measurable"]:
        return NOT_MEASURABLE
    intra = reuse["breakdown"]["intra_session"]
    return (
        f"An ideal infinite KV store skips {pct(reuse['ratio'])} of prompt tokens; "
        f"{pct(intra)} of that reuse comes from earlier turns of the same session."
    )


def _intervals_finding(intervals: Section) -> str:
    p = intervals["percentiles"]
    return (
        f"Half of all reuses happen within {seconds(p['p50'])} of the previous request "
        f"completing and 90% within {seconds(p['p90'])}; "
        f"{pct(intervals['within']['100'])} happen within 100 s."
    )


def _triggers_finding(triggers: Section) -> str:
    requests = shares(triggers["requests"])
    tokens = shares(triggers["tokens"])
    top = max(requests, key=requests.__getitem__)
    return (
        f"{pct(requests[top])} of requests ({pct(tokens[top])} of tokens) "
        f"are triggered by {TRIGGER_SOURCES[top]}."
    )


def _usage_finding(usage: Section) -> str:
    return (
        f"Token usage is skewed: the top 10% of sessions use {pct(usage['top_share']['10%'])} "
        f"of all tokens (Gini {usage['gini']:.2f})."
    )


def _balance_finding(balance: Section) -> str:
    imbalance = balance["imbalance"]
    rate = balance["requests_per_min_per_instance"]["mean"]
    ramp = balance.get("ramp_up_windows", 0)
    after = (
        f" once the load has ramped up (the first {ramp} window"
        f"{'s' if ramp != 1 else ''}, below half the median load, left out)"
        if ramp
        else ""
    )
    return (
        f"Least-in-flight-tokens dispatch over {balance['instances']} instances keeps the "
        f"per-window imbalance (max/mean) at a median of {times(imbalance['p50'])} and at most "
        f"{times(imbalance['max'])}{after}, with {rate:.1f} requests per minute per instance."
    )


FINDINGS: dict[str, Callable[[Section], str]] = {
    "reuse": _reuse_finding,
    "reuse_intervals": _intervals_finding,
    "triggers": _triggers_finding,
    "session_usage": _usage_finding,
    "balance": _balance_finding,
}


def finding(result: Mapping[str, Any], name: str) -> str:
    """State a section's finding in one plain sentence with its headline number."""
    return FINDINGS[name](result[name])


def trace_facts(trace: Section) -> list[tuple[str, str]]:
    """Describe the trace and how much of it was recorded rather than inferred."""
    return [
        ("Format", trace["format"]),
        ("Requests", count(trace["requests"])),
        (
            "Sessions",
            count(trace["sessions"]) + (" (inferred)" if trace["sessions_inferred"] else ""),
        ),
        ("Clock", "recorded" if trace["has_clock"] else "none"),
        ("Block size", "n/a" if trace["block_size"] is None else f"{trace['block_size']} tokens"),
        ("Skipped records", count(sum(trace.get("skipped", {}).values()))),
    ]


def _kv_table(name: str, rows: Sequence[tuple[str, str]]) -> tables.Table:
    columns = (tables.Column("metric", "left"), tables.Column("value"))
    values = tuple({"metric": label, "value": value} for label, value in rows)
    return tables.Table(name, TITLES[name], columns, tuple(rows), values)


def _reuse_rows(reuse: Section) -> list[tuple[str, str]]:
    rows = [
        ("Ideal reuse ratio", f"{pct(reuse['ratio'])} of {count(reuse['prompt_tokens'])} tokens")
    ]
    for key in ("intra_session", "inter_session", "system_prompt"):
        rows.append((REUSE_SOURCES[key], f"{pct(reuse['breakdown'][key])} of hits"))
    if "cross_session_share" in reuse:
        rows.append(("From other sessions", f"{pct(reuse['cross_session_share'])} of hits"))
    return rows


def _intervals_rows(intervals: Section) -> list[tuple[str, str]]:
    p = intervals["percentiles"]
    within = intervals["within"]
    return [
        ("Reuses", f"{count(intervals['count'])} ({intervals['clock']} clock)"),
        ("p50 / p90 / p99", " / ".join(seconds(p[key]) for key in ("p50", "p90", "p99"))),
        (
            "Within 10 s / 100 s / 1000 s",
            " / ".join(pct(within[key]) for key in ("10", "100", "1000")),
        ),
    ]


def _usage_rows(usage: Section) -> list[tuple[str, str]]:
    top = usage["top_share"]
    return [
        ("Sessions", count(usage["sessions"])),
        ("Mean / p50 tokens", f"{count(usage['mean'])} / {count(usage['p50'])}"),
        ("p90 / p99 / max tokens", " / ".join(count(usage[key]) for key in ("p90", "p99", "max"))),
        ("Top 1% / 10% / 20% share", " / ".join(pct(top[key]) for key in ("1%", "10%", "20%"))),
        ("Gini", f"{usage['gini']:.2f}"),
    ]


def _balance_rows(balance: Section) -> list[tuple[str, str]]:
    rate = balance["requests_per_min_per_instance"]
    imbalance = balance["imbalance"]
    return [
        ("Instances / window", f"{balance['instances']} / {seconds(balance['window_s'])}"),
        ("Arrivals / durations", f"{balance['arrivals']} / {balance['durations']}"),
        (
            "Requests/min/instance",
            f"{rate['mean']:.1f} (min {rate['min']:.1f}, max {rate['max']:.1f})",
        ),
        ("Imbalance mean / p50", f"{times(imbalance['mean'])} / {times(imbalance['p50'])}"),
        ("Imbalance p90 / max", f"{times(imbalance['p90'])} / {times(imbalance['max'])}"),
    ]


def _triggers_table(triggers: Section) -> tables.Table:
    columns = (
        tables.Column("trigger", "left"),
        *(tables.Column(h) for h in ("requests", "share", "tokens", "token share")),
    )
    requests, tokens = shares(triggers["requests"]), shares(triggers["tokens"])
    rows, values = [], []
    for key in TRIGGER_SOURCES:
        rows.append(
            (
                key,
                count(triggers["requests"][key]),
                pct(requests[key]),
                count(triggers["tokens"][key]),
                pct(tokens[key]),
            )
        )
        values.append(
            {
                "trigger": key,
                "requests": triggers["requests"][key],
                "share": requests[key],
                "tokens": triggers["tokens"][key],
                "token_share": tokens[key],
            }
        )
    return tables.Table("triggers", TITLES["triggers"], columns, tuple(rows), tuple(values))


_ROWS: dict[str, Callable[[Section], list[tuple[str, str]]]] = {
    "reuse": _reuse_rows,
    "reuse_intervals": _intervals_rows,
    "session_usage": _usage_rows,
    "balance": _balance_rows,
}


def section_table(name: str, section: Section) -> tables.Table | None:
    """A finding's numbers as a table (None where the trace cannot measure them)."""
    if name == "triggers":
        return _triggers_table(section)
    if not section.get("measurable", True):
        return None
    return _kv_table(name, _ROWS[name](section))


def section_tables(result: Mapping[str, Any]) -> list[tables.Table]:
    """Every finding's table, in the report's order."""
    found = (section_table(n, result[n]) for n in TITLES if result.get(n) is not None)
    return [t for t in found if t is not None]


def render_summary(result: Mapping[str, Any], console: Console) -> None:
    """Print the trace header, then per finding its sentence and a compact table of numbers."""
    trace = result["trace"]
    facts = Table.grid(padding=(0, 2))
    for label, value in trace_facts(trace):
        facts.add_row(Text(label, style="bold"), Text(value))
    notes = [Text(f"• {note}", style="yellow") for note in trace["notes"]]
    title = Text(f"Trace {trace['name']}")
    console.print(Panel(Group(facts, *notes), title=title, title_align="left", expand=False))
    for name, heading in TITLES.items():
        section = result.get(name)
        if section is None:
            continue
        console.print()
        console.rule(Text(heading, style="bold cyan"), align="left")
        console.print(Text(finding(result, name), style="italic"))
        table = section_table(name, section)
        if table is not None:
            tables.print_table(dataclasses.replace(table, title=""), console)
