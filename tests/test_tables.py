"""Tables never cut a number: folded to the terminal's width, or printed as blocks, and
the same rows for scripts as csv, json or Markdown."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from smetric.report.run_tables import results_table
from smetric.report.tables import emit, print_table, to_csv, to_markdown

ROOT = Path(__file__).resolve().parents[1]


def summary(tps: float, ttft_p99: float, sticky_session: float) -> dict:
    return {
        "tps_within_slo": tps,
        "slo_attainment": 0.953,
        "ttft_s": {"p50": 0.52, "p90": 5.0, "p99": ttft_p99},
        "tpot_s": {"p50": 0.010, "p90": 0.016, "p99": 0.046},
        "reuse": {"local": 0.47, "global": 0.47},
        "imbalance": {"mean": 10.734},
        "stickiness": {"session": sticky_session, "agent": 0.21, "turn": 0.55},
    }


SUMMARIES = {
    "smetric": summary(38_123_456.0, 151.8, 0.16),
    "smetric_cost:decode_weight=1": summary(265_700.0, 28.3, 0.12),
    "least_load": summary(259_100.0, 32.5, 0.07),
}


def printed(width: int, fmt: str = "table") -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    emit([results_table("runs", SUMMARIES)], fmt, console)
    return out.getvalue()


@pytest.mark.parametrize("width", [30, 60, 80, 200])
def test_every_cell_is_printed_whole_at_any_width(width: int) -> None:
    table = results_table("runs", SUMMARIES)
    text = printed(width)
    assert "…" not in text
    for row in table.rows:
        for cell in row:
            assert cell in text, (width, cell)
    assert all(len(line) <= width for line in text.splitlines())


def test_the_main_table_shows_p99_latency_and_per_session_stickiness() -> None:
    table = results_table("runs", SUMMARIES)
    headers = [c.flat for c in table.columns]
    assert "TTFT s p50/p90/p99" in headers and "sticky % sess/agent/turn" in headers
    row = dict(zip(headers, table.rows[0], strict=True))
    assert row["TTFT s p50/p90/p99"] == "0.52/5.00/151.80"
    assert row["TPOT ms p50/p90/p99"] == "10/16/46"
    assert row["sticky % sess/agent/turn"] == "16/21/55"
    assert row["TPS @SLO"] == "38,123,456" and row["imbalance"] == "10.73x"


def test_wide_tables_fold_into_column_groups_with_the_labels_repeated() -> None:
    text = printed(60)
    # Every group repeats the policy column.
    assert text.count("smetric_cost:decode_weight=1") >= 2
    narrow = printed(30)
    # Too narrow for any column beside the labels: one block of lines per row.
    assert "  TTFT s p50/p90/p99" in narrow


def test_csv_json_and_markdown_carry_the_same_rows() -> None:
    table = results_table("runs", SUMMARIES)
    rows = list(csv.DictReader(io.StringIO(to_csv(table))))
    assert [r["policy"] for r in rows] == list(SUMMARIES)
    assert float(rows[0]["tps_within_slo"]) == 38_123_456.0
    assert float(rows[1]["ttft_p99_s"]) == 28.3 and float(rows[2]["sticky_session"]) == 0.07
    document = json.loads(printed(80, "json"))
    assert document["runs"][0]["ttft_p99_s"] == 151.8
    markdown = to_markdown(table)
    assert "| smetric | **38,123,456** |" in markdown
    assert "| policy | TPS @SLO | SLO met | TTFT s p50/p90/p99 |" in markdown


def test_a_narrow_table_prints_blocks_of_whole_values() -> None:
    out = io.StringIO()
    print_table(results_table("runs", SUMMARIES), Console(file=out, width=24))
    text = out.getvalue()
    assert "38,123,456" in text and "0.52/5.00/151.80" in text and "…" not in text


@pytest.mark.subprocess
def test_simulate_piped_at_80_columns_prints_its_numbers_whole(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        *("simulate", "--instances", "2", "--duration", "60", "-j", "1", "-o", str(out)),
        *("-p", "smetric,least_load", "--prefill-instances", "2", "--decode-instances", "1"),
    ]
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "smetric", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "…" not in run.stdout
    assert all(len(line) <= 80 for line in run.stdout.splitlines())
    policies = json.loads((out / "summary.json").read_text())["policies"]
    for s in policies.values():
        assert f"{s['tps_within_slo']:,.0f}" in run.stdout
        assert f"{s['ttft_s']['p99']:.2f}" in run.stdout
        assert f"{s['pd']['prefill_ttft_s']['p99']:.2f}" in run.stdout
    report = ["report", str(out), "-o", str(tmp_path / "r"), "--format", "csv"]
    scripted = subprocess.run(
        [sys.executable, "-m", "smetric", *report],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert scripted.returncode == 0, scripted.stderr
    rows = list(csv.DictReader(io.StringIO(scripted.stdout)))
    assert {r["policy"] for r in rows} == set(policies)
    for r in rows:
        assert float(r["tps_within_slo"]) == policies[r["policy"]]["tps_within_slo"]


def test_cells_with_spaces_are_never_squeezed_into_a_cut() -> None:
    from smetric.report.tables import Column, Table

    columns = (Column("id", "left"), *(Column(h, "left") for h in ("role", "note", "within")))
    rows = tuple((f"anchor-{i}", "held out", "no reason given yet", "yes") for i in range(3))
    table = Table("t", "t", columns, rows, tuple({"id": r[0]} for r in rows))
    for width in (30, 40, 60):
        out = io.StringIO()
        print_table(table, Console(file=out, width=width))
        text = out.getvalue()
        assert text.count("held out") == 3 and text.count("no reason given yet") == 3, text
