"""The ``smetric`` command line: a thin shell over the trace layer, analysis and reports."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import polars as pl
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from smetric.trace.load import DEFAULT_SAMPLE, FORMATS, count_units, load_trace, write_parquet
from smetric.trace.schema import Trace, TraceError

app = typer.Typer(
    help=(
        "SMetric: balanced session-centric scheduling for agentic LLM serving.\n\n"
        "Study a trace's KV reuse (analyze), inspect and convert traces (trace)."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
trace_app = typer.Typer(help="Inspect and convert request traces.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")

console = Console()
err_console = Console(stderr=True)

TraceArg = Annotated[
    str,
    typer.Argument(
        help="Trace file or folder (WEKA folder, Mooncake/Bailian .jsonl, Azure .csv, "
        "SMetric .parquet), or sample:weka / sample:mooncake for the embedded samples."
    ),
]
FormatOpt = Annotated[
    str | None,
    typer.Option("--format", "-f", help=f"Trace format, if not detected: {', '.join(FORMATS)}."),
]


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input ends with one located line and exit code 2, never a traceback."""
    try:
        yield
    except TraceError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    except ValueError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


def load_with_progress(source: str, fmt: str | None) -> Trace:
    with _progress() as progress:
        task = progress.add_task(f"loading {source}", total=count_units(source))
        trace = load_trace(source, fmt, progress=lambda n: progress.advance(task, n))
    return trace


@trace_app.command("info")
def trace_info(source: TraceArg = DEFAULT_SAMPLE, fmt: FormatOpt = None) -> None:
    """Summarise a trace: requests, sessions, clock, tokens, blocks, triggers."""
    with user_errors():
        started = time.perf_counter()
        trace = load_with_progress(source, fmt)
        elapsed = time.perf_counter() - started
    frame = trace.requests
    table = Table(title=f"{trace.name} ({trace.source_format})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    span = frame["arrival_s"] if trace.has_clock else frame["session_time_s"]
    rows = {
        "requests": f"{trace.num_requests:,}",
        "sessions": f"{trace.num_sessions:,}" + (" (inferred)" if trace.sessions_inferred else ""),
        "agents": f"{frame.select(['session_id', 'agent_id']).n_unique():,}",
        "clock": "global" if trace.has_clock else "per session only",
        "time span": f"{(span.max() or 0) - (span.min() or 0):,.1f} s",
        "input tokens": _total_and_mean(frame["input_tokens"]),
        "output tokens": _total_and_mean(frame["output_tokens"]),
        "block size": ", ".join(str(b) for b in sorted(frame["block_size"].unique().to_list())),
        "blocks": f"{frame['block_ids'].list.len().sum():,}",
        "triggers": ", ".join(
            f"{row['trigger']} {row['count']:,}"
            for row in frame["trigger"].value_counts(sort=True).iter_rows(named=True)
        ),
        "loaded in": f"{elapsed:.2f} s",
    }
    for key, value in rows.items():
        table.add_row(key, value)
    console.print(table)
    for note in trace.notes:
        console.print(f"[dim]note: {note}[/]")


def _total_and_mean(column: pl.Series) -> str:
    return f"{column.sum():,} (mean {column.mean() or 0:,.0f})"


@trace_app.command("convert")
def trace_convert(
    source: TraceArg,
    out: Annotated[Path, typer.Argument(help="Output .parquet file (normalised request table).")],
    fmt: FormatOpt = None,
) -> None:
    """Convert any supported trace to SMetric's normalised Parquet request table."""
    with user_errors():
        if out.suffix != ".parquet":
            raise ValueError(f"{out}: the output must be a .parquet file")
        trace = load_with_progress(source, fmt)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_parquet(trace, out)
    console.print(f"wrote {trace.num_requests:,} requests to {out}")


@app.command()
def analyze(
    source: TraceArg = DEFAULT_SAMPLE,
    fmt: FormatOpt = None,
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
) -> None:
    """The paper's workload study (§3) on a trace: KV reuse and where it comes from.

    Writes analysis.json (every figure's data), one PNG per figure and a self-contained
    report.html, and prints a summary.
    """
    from smetric.report.figures import write_pngs
    from smetric.report.html import write_html
    from smetric.report.terminal import render_summary
    from smetric.trace.analysis import AnalysisOptions
    from smetric.trace.analysis import analyze as run_analysis

    with user_errors():
        trace = load_with_progress(source, fmt)
        options = AnalysisOptions(
            instances=instances,
            window_s=window,
            session_rate=session_rate,
            layout_s=layout,
            seed=seed,
        )
        with _progress() as progress:
            task = progress.add_task("analysing", total=trace.num_requests)
            result = run_analysis(trace, options, progress=lambda n: progress.advance(task, n))
    out = out or Path("smetric-out") / f"analyze-{_slug(trace.name)}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(result, indent=1))
    pngs = write_pngs(result, out)
    write_html(result, pngs, out / "report.html")
    render_summary(result, console)
    console.print(f"\nwrote {out / 'analysis.json'}, {len(pngs)} plots and {out / 'report.html'}")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-") or "trace"


if __name__ == "__main__":
    app()
