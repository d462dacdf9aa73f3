"""Knee-search results as table rows (``smetric knee``'s table, ``smetric reproduce``'s
Figure 11a/16a table): one row per policy, then each compared policy's lead over the best
baseline at its best setting."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from smetric.metrics.results import KneeSummary
from smetric.report.markdown import markdown_table


def knee_rows(
    summary: KneeSummary,
    compared: Sequence[str],
    number: Callable[[float], str],
    bold: Callable[[str], str],
) -> list[list[str]]:
    """One row per policy (the best knee of each cell in bold; ± the spread over seeds
    where there were several), then one per policy of ``compared`` that ran: its lead
    over the cell's best baseline."""
    rows = []
    for p in summary.policies:
        row = [p]
        for cell in summary.cells:
            k = cell.knees[p]
            top = max(v.mean for v in cell.knees.values())
            spread = f" ± {number(k.stdev)}" if len(k.seeds) > 1 else ""
            text = f"{number(k.mean)}{spread} (@{k.load:.3g})"
            row.append(bold(text) if k.mean == top and top > 0 else text)
        rows.append(row)
    for policy in (p for p in compared if p in summary.policies):
        row = [f"{policy} vs best baseline"]
        for cell in summary.cells:
            rival = cell.best_baseline
            theirs = cell.knees[rival].mean if rival else 0.0
            ours = cell.knees[policy].mean
            row.append(f"{(ours / theirs - 1) * 100:+.1f} % vs {rival}" if theirs else "-")
        rows.append(row)
    return rows


def knee_markdown(summary: KneeSummary, compared: Sequence[str]) -> str:
    """The knee table as Markdown, for results pages."""
    head = [f"global {c.global_}, {c.kv_load} load" for c in summary.cells]
    rows = knee_rows(summary, compared, lambda v: f"{v / 1000:,.1f}k", lambda t: f"**{t}**")
    return markdown_table(["policy", *head], rows)
