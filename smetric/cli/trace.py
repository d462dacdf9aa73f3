"""``smetric trace``: inspect and convert request traces."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import polars as pl
import typer

from smetric.cli.app import (
    TableFormatOpt,
    TraceArg,
    TraceFormatOpt,
    app,
    console,
    load_with_progress,
    out_console,
    user_errors,
)
from smetric.core.errors import UserError
from smetric.report.tables import Column, Table, check_format, emit
from smetric.trace.load import DEFAULT_SAMPLE, write_parquet

trace_app = typer.Typer(help="Inspect and convert request traces.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")


@trace_app.command("info")
def trace_info(
    source: TraceArg = DEFAULT_SAMPLE,
    fmt: TraceFormatOpt = None,
    table_format: TableFormatOpt = "table",
) -> None:
    """Summarise a trace: requests, sessions, clock, tokens, blocks, triggers."""
    with user_errors():
        check_format(table_format)
        started = time.perf_counter()
        trace = load_with_progress(source, fmt)
        elapsed = time.perf_counter() - started
    frame = trace.requests
    span = pl.col("arrival_s" if trace.has_clock else "session_time_s")
    rows = {
        "requests": f"{trace.num_requests:,}",
        "sessions": f"{trace.num_sessions:,}" + (" (inferred)" if trace.sessions_inferred else ""),
        "agents": f"{frame.select(['session_id', 'agent_id']).n_unique():,}",
        "clock": "global" if trace.has_clock else "per session only",
        "time span": f"{frame.select(span.max() - span.min()).item() or 0:,.1f} s",
        "input tokens": _total_and_mean(frame, "input_tokens"),
        "output tokens": _total_and_mean(frame, "output_tokens"),
        "block size": ", ".join(str(b) for b in sorted(frame["block_size"].unique().to_list())),
        "blocks": f"{frame['block_ids'].list.len().sum():,}",
        "triggers": ", ".join(
            f"{row['trigger']} {row['count']:,}"
            for row in frame["trigger"].value_counts(sort=True).iter_rows(named=True)
        ),
        "skipped records": trace.skipped_text(),
        "loaded in": f"{elapsed:.2f} s",
    }
    columns = (Column("fact", "left"), Column("value", "left", wrap=True))
    values = tuple({"fact": k, "value": v} for k, v in rows.items())
    title = f"{trace.name} ({trace.source_format})"
    emit([Table("trace", title, columns, tuple(rows.items()), values)], table_format, console)
    for note in trace.notes:
        out_console(table_format).print(f"[dim]note: {note}[/]")


def _total_and_mean(frame: pl.DataFrame, name: str) -> str:
    total, mean = frame.select(pl.col(name).sum(), pl.col(name).mean().alias("mean")).row(0)
    return f"{total:,} (mean {mean or 0:,.0f})"


@trace_app.command("convert")
def trace_convert(
    source: TraceArg,
    out: Annotated[Path, typer.Argument(help="Output .parquet file (normalised request table).")],
    fmt: TraceFormatOpt = None,
) -> None:
    """Convert any supported trace to SMetric's normalised Parquet request table."""
    with user_errors():
        if out.suffix != ".parquet":
            raise UserError(f"{out}: the output must be a .parquet file")
        trace = load_with_progress(source, fmt)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_parquet(trace, out)
    console.print(f"wrote {trace.num_requests:,} requests to {out}")
