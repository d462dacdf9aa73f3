"""``smetric analyze``: the paper's workload study (§3) on any trace."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from smetric.cli.app import (
    TableFormatOpt,
    TraceArg,
    TraceFormatOpt,
    app,
    console,
    load_with_progress,
    out_console,
    progress_bar,
    slug,
    user_errors,
)
from smetric.report.tables import Column, Table, check_format, emit
from smetric.trace.load import DEFAULT_SAMPLE


@app.command()
def analyze(
    source: TraceArg = DEFAULT_SAMPLE,
    fmt: TraceFormatOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder [default: smetric-out/analyze-NAME]."),
    ] = None,
    instances: Annotated[
        int, typer.Option(min=1, help="Instances for the balance study (Figure 9).")
    ] = 32,
    window: Annotated[
        float, typer.Option(min=1.0, help="Window in seconds for per-window load imbalance.")
    ] = 60.0,
    session_rate: Annotated[
        float,
        typer.Option(
            min=1e-6,
            help="Sessions/s used to lay out a trace without a global clock (Poisson starts).",
        ),
    ] = 0.5,
    layout: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="Seconds during which sessions keep starting, for a trace without a clock.",
        ),
    ] = 3600.0,
    seed: Annotated[int, typer.Option(help="Seed for laying out sessions.")] = 0,
    table_format: TableFormatOpt = "table",
) -> None:
    """The paper's workload study (§3) on a trace: KV reuse and where it comes from.

    Writes analysis.json (every figure's data), one PNG per figure and a self-contained
    report.html, and prints a summary. With --format json it prints analysis.json; with
    csv, one row per figure's number (section, metric, value).
    """
    from smetric.report.figures import write_pngs
    from smetric.report.html import write_html
    from smetric.report.terminal import render_summary, section_tables
    from smetric.trace.analysis import AnalysisOptions
    from smetric.trace.analysis import analyze as run_analysis

    with user_errors():
        check_format(table_format)
        trace = load_with_progress(source, fmt)
        options = AnalysisOptions(
            instances=instances,
            window_s=window,
            session_rate=session_rate,
            layout_s=layout,
            seed=seed,
        )
        with progress_bar() as progress:
            task = progress.add_task("analysing", total=trace.num_requests)
            result = run_analysis(trace, options, progress=lambda n: progress.advance(task, n))
    out = out or Path("smetric-out") / f"analyze-{slug(trace.name)}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(result.to_json())
    pngs = write_pngs(result, out)
    write_html(result, pngs, out / "report.html")
    if table_format == "table":
        render_summary(result, console)
    elif table_format == "json":
        console.out(result.to_json(), highlight=False)
    else:
        found = section_tables(result)
        emit([_flat(found)] if table_format == "csv" else found, table_format, console)
    out_console(table_format).print(
        f"\nwrote {out / 'analysis.json'}, {len(pngs)} plots and {out / 'report.html'}"
    )


def _flat(tables: list[Table]) -> Table:
    """Every finding's numbers in one table of (section, metric, value) rows, for csv."""
    rows = [
        (t.name, row[0], cell)
        for t in tables
        for row in t.rows
        for cell in (row[1:] if len(row) == 2 else (" · ".join(row[1:]),))
    ]
    columns = (Column("section", "left"), Column("metric", "left"), Column("value"))
    values = tuple({"section": s, "metric": m, "value": v} for s, m, v in rows)
    return Table("findings", "Findings", columns, tuple(rows), values)
