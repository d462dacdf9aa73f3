"""``smetric report``: simulated and measured runs side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from smetric.cli.app import TableFormatOpt, app, console, out_console, user_errors
from smetric.metrics.runs import load_runs
from smetric.report.run_tables import results_table
from smetric.report.tables import check_format, emit


@app.command()
def report(
    folders: Annotated[
        list[Path],
        typer.Argument(help="Result folders written by `smetric simulate` or `smetric replay`."),
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder for the figures.", show_default=False),
    ] = None,
    table_format: TableFormatOpt = "table",
) -> None:
    """Compare runs side by side: one table and the simulator's figures for all of them.

    Every run in each folder becomes a row (each policy of a simulation, the replay of a
    measured run); with several folders rows are named FOLDER/run. Writes tps, reuse,
    imbalance, heatmaps, latency and stickiness PNGs [default folder: smetric-out/report].
    """
    from smetric.report.simulation import write_simulation_pngs

    with user_errors():
        check_format(table_format)
        summaries, tables = load_runs(folders)
        out = out or Path("smetric-out") / "report"
        figures = write_simulation_pngs(summaries, tables, out)
    title = f"{len(summaries)} runs from {len(folders)} folder{'s' * (len(folders) > 1)}"
    emit([results_table(title, summaries)], table_format, console)
    out_console(table_format).print(f"wrote {len(figures)} figures to {out}/")
