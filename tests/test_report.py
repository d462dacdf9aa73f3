"""Report rendering: PNGs, the self-contained HTML page and the terminal summary."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import matplotlib.image
import numpy as np
import pytest
from rich.console import Console

from smetric.report.figures import DPI, figures, write_pngs
from smetric.report.html import write_html
from smetric.report.terminal import render_summary
from smetric.trace.analysis.results import Analysis

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _lorenz(tokens: np.ndarray) -> dict[str, list[float]]:
    ascending = np.sort(tokens)
    y = np.concatenate([[0.0], np.cumsum(ascending) / ascending.sum()])
    x = np.linspace(0, 1, len(y))
    return {"x": x.tolist(), "y": y.tolist()}


def complete_data() -> dict[str, Any]:
    """A small result with every section filled, numbers chosen to be easy to spot, as
    an older ``analysis.json`` has it (before skipped records, the cross-session share and
    the ramp-up were written)."""
    rng = np.random.default_rng(7)
    tokens = np.sort((rng.pareto(1.2, 300) + 1) * 5_000).astype(int)[::-1]
    intervals = np.sort(rng.lognormal(1.5, 1.8, 500))
    imbalance = (1.3 + 0.3 * rng.random(60)).tolist()
    imbalance[10] = 2.4
    return {
        "trace": {
            "name": "trace-1",
            "format": "bailian",
            "requests": 12_345,
            "sessions": 300,
            "has_clock": True,
            "sessions_inferred": True,
            "block_size": 16,
            "notes": ["sessions inferred from parent ids"],
        },
        "reuse": {
            "prompt_tokens": 1_000_000,
            "hit_tokens": 961_000,
            "ratio": 0.961,
            "intra_session_tokens": 644_000,
            "inter_session_tokens": 144_000,
            "system_prompt_tokens": 173_000,
            "breakdown": {"intra_session": 0.67, "inter_session": 0.15, "system_prompt": 0.18},
            "measurable": True,
        },
        "reuse_intervals": {
            "clock": "global",
            "count": 500,
            "percentiles": {"p50": 4.3, "p90": 95.0, "p99": 1800.0},
            "within": {"10": 0.642, "100": 0.903, "1000": 0.981},
            "cdf": {
                "x": [0.0, *intervals.tolist()],
                "y": [0.05, *np.linspace(0.052, 1, len(intervals)).tolist()],
            },
        },
        "triggers": {
            "requests": {"user": 120, "agent": 850, "compaction": 20, "unknown": 10},
            "tokens": {"user": 50_000, "agent": 900_000, "compaction": 40_000, "unknown": 10_000},
        },
        "session_usage": {
            "sessions": 300,
            "mean": float(tokens.mean()),
            "p50": float(np.median(tokens)),
            "p90": float(np.percentile(tokens, 90)),
            "p99": float(np.percentile(tokens, 99)),
            "max": float(tokens.max()),
            "top_share": {"1%": 0.213, "10%": 0.623, "20%": 0.745},
            "gini": 0.71,
            "lorenz": _lorenz(tokens),
            "per_session_tokens": tokens.tolist(),
        },
        "balance": {
            "instances": 32,
            "window_s": 60.0,
            "arrivals": "recorded",
            "durations": "estimated",
            "requests_per_min_per_instance": {
                "mean": 43.2,
                "min": 30.5,
                "max": 51.0,
                "series": (43 + rng.normal(0, 4, 60)).tolist(),
            },
            "imbalance": {
                "mean": 1.52,
                "p50": 1.47,
                "p90": 1.75,
                "max": 2.4,
                "series": imbalance,
            },
            "heatmap": (rng.random((32, 60)) * 40_000).tolist(),
        },
    }


def complete_result() -> Analysis:
    return Analysis.from_builtins(complete_data())


def sparse_result() -> Analysis:
    """An Azure-like result: no block ids, so reuse is not measurable and its intervals
    are absent."""
    data = complete_data()
    data["trace"].update(name="<script>alert(1)</script>", has_clock=False, block_size=None)
    data["reuse"].update(measurable=False, hit_tokens=0, ratio=0.0)
    data["reuse_intervals"] = None
    return Analysis.from_builtins(data)


@pytest.fixture(scope="module")
def complete(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], str]:
    out = tmp_path_factory.mktemp("complete")
    pngs = write_pngs(complete_result(), out)
    write_html(complete_result(), pngs, out / "report.html")
    return pngs, (out / "report.html").read_text(encoding="utf-8")


def _summary(result: Analysis) -> str:
    console = Console(record=True, width=100)
    render_summary(result, console)
    return console.export_text()


def test_every_figure_is_a_readable_png(complete: tuple[dict[str, Path], str]) -> None:
    pngs, _ = complete
    drawn = figures(complete_result())
    assert list(pngs) == ["reuse", "reuse_intervals", "triggers", "session_usage", "balance"]
    assert list(pngs) == list(drawn)
    for name, path in pngs.items():
        assert path.name == f"{name}.png"
        assert path.read_bytes().startswith(PNG_SIGNATURE)
        pixels = matplotlib.image.imread(path)
        width, height = drawn[name]().get_size_inches() * DPI
        assert pixels.shape[:2] == (round(height), round(width))
        assert pixels.std() > 0  # something was drawn, not a blank canvas


def test_html_embeds_each_figure_and_nothing_external(
    complete: tuple[dict[str, Path], str],
) -> None:
    pngs, page = complete
    assert page.count('src="data:image/png;base64,') == len(pngs)
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<link" not in page and "<script" not in page


def test_html_states_key_numbers(complete: tuple[dict[str, Path], str]) -> None:
    _, page = complete
    for text in (
        "96.1%",  # ideal reuse ratio
        "67.0% / 15.0% / 18.0%",  # intra / inter / system-prompt split
        "4.3 s / 95.0 s",  # p50 / p90 reuse interval
        "agent 85.0%",  # dominant trigger
        "62.3%",  # top-10% session token share
        "1.52x / 2.40x",  # mean / max imbalance
        "sessions inferred from parent ids",
    ):
        assert text in page


def test_terminal_summary_states_key_numbers() -> None:
    text = _summary(complete_result())
    for number in ("96.1%", "67.0%", "4.3 s", "90.3%", "85.0%", "62.3%", "2.40x"):
        assert number in text
    assert "12,345" in text and "sessions inferred" in text


def test_absent_sections_are_skipped(tmp_path: Path) -> None:
    result = sparse_result()
    pngs = write_pngs(result, tmp_path)
    assert list(pngs) == ["triggers", "session_usage", "balance"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{n}.png" for n in sorted(pngs)]

    write_html(result, pngs, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 3
    assert "not measurable" in page.lower()
    assert "Figure 6" not in page and "Figure 9" in page

    text = _summary(result)
    assert "Not measurable" in text and "Figure 6" not in text and "Figure 9" in text


def test_trace_name_is_escaped(tmp_path: Path) -> None:
    result = sparse_result()
    write_html(result, {}, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>alert(1)</script>" in _summary(result)


def test_an_older_file_loads_and_a_result_round_trips() -> None:
    # Older files lack the fields added since; they load with what those fields meant.
    old = complete_result()
    assert old.trace.skipped == {} and old.reuse.cross_session_share is None
    assert old.balance.ramp_up_windows == 0
    assert old.session_usage.top_share.top_10 == 0.623  # the file's "10%"
    # A result is written with every field, in the file's key order, and reads back.
    written = json.loads(old.to_json())
    assert list(written["trace"]) == [
        *("name", "format", "requests", "sessions", "has_clock", "sessions_inferred"),
        *("block_size", "skipped", "notes"),
    ]
    assert written["balance"]["ramp_up_windows"] == 0  # written, though the default
    assert written["session_usage"]["top_share"] == {"1%": 0.213, "10%": 0.623, "20%": 0.745}
    assert Analysis.from_json(old.to_json()) == old


def test_a_file_that_is_no_analysis_names_the_schema() -> None:
    data = complete_data()
    del data["triggers"]
    with pytest.raises(ValueError, match="Analysis of results schema version 1"):
        Analysis.from_builtins(data)
