"""Single-file HTML report of the workload findings.

Everything the page needs (PNGs as base64 data URIs, CSS inline) is embedded so that the
report can be mailed or attached to an issue as one file and still render offline.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import jinja2

from smetric.report.terminal import (
    count,
    findings,
    pct,
    seconds,
    shares,
    times,
    trace_facts,
)
from smetric.trace.analysis.results import (
    Analysis,
    Balance,
    ReuseIntervals,
    ReuseShares,
    SessionUsage,
    Triggers,
)


class KeyNumber(NamedTuple):
    label: str
    value: str
    note: str


class FigureBlock(NamedTuple):
    title: str
    caption: str
    src: str | None  # None when the section has nothing to draw (e.g. reuse not measurable)


def _reuse_numbers(reuse: ReuseShares) -> list[KeyNumber]:
    if not reuse.measurable:
        return [KeyNumber("Ideal KV-cache reuse", "not measurable", "trace has no block ids")]
    split = reuse.breakdown
    return [
        KeyNumber(
            "Ideal KV-cache reuse",
            pct(reuse.ratio),
            f"of {count(reuse.prompt_tokens)} prompt tokens",
        ),
        KeyNumber(
            "Reuse split",
            " / ".join(
                pct(v) for v in (split.intra_session, split.inter_session, split.system_prompt)
            ),
            "intra-session / inter-session / system prompt",
        ),
    ]


def _intervals_numbers(intervals: ReuseIntervals) -> KeyNumber:
    p = intervals.percentiles
    return KeyNumber(
        "Reuse interval",
        f"{seconds(p.p50)} / {seconds(p.p90)}",
        f"p50 / p90, {intervals.clock} clock",
    )


def _triggers_numbers(triggers: Triggers) -> KeyNumber:
    ranked = sorted(shares(triggers.requests).items(), key=lambda kv: kv[1], reverse=True)
    (top, top_share), rest = ranked[0], ranked[1:]
    note = " · ".join(f"{key} {pct(share)}" for key, share in rest)
    return KeyNumber("Requests triggered by", f"{top} {pct(top_share)}", note)


def _usage_numbers(usage: SessionUsage) -> KeyNumber:
    return KeyNumber(
        "Top-10% sessions", pct(usage.top_share.top_10), f"of all tokens, Gini {usage.gini:.2f}"
    )


def _balance_numbers(balance: Balance) -> KeyNumber:
    imbalance = balance.imbalance
    return KeyNumber(
        "Load imbalance",
        f"{times(imbalance.mean)} / {times(imbalance.max)}",
        f"mean / max per window, {balance.instances} instances",
    )


def key_numbers(result: Analysis) -> list[KeyNumber]:
    """The headline number of each present finding, for the panel at the top of the page."""
    numbers = _reuse_numbers(result.reuse)
    if result.reuse_intervals is not None:
        numbers.append(_intervals_numbers(result.reuse_intervals))
    return [
        *numbers,
        _triggers_numbers(result.triggers),
        _usage_numbers(result.session_usage),
        _balance_numbers(result.balance),
    ]


def _data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def _figure_blocks(result: Analysis, pngs: Mapping[str, Path]) -> list[FigureBlock]:
    return [
        FigureBlock(f.title, f.sentence, _data_uri(pngs[f.name]) if f.name in pngs else None)
        for f in findings(result)
    ]


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("smetric.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def write_html(result: Analysis, pngs: Mapping[str, Path], path: Path) -> None:
    """Render the one-page report; ``pngs`` maps section names to files from ``write_pngs``."""
    trace = result.trace
    page = (
        _environment()
        .get_template("analysis.html.j2")
        .render(
            trace=trace,
            facts=trace_facts(trace),
            numbers=key_numbers(result),
            figures=_figure_blocks(result, pngs),
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
