"""What every ``smetric`` command shares: the app, consoles, error handling, progress."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from smetric.cli.errors import Debug, err_console, user_errors
from smetric.cli.help import ProseGroup
from smetric.metrics.runs import safe_name
from smetric.report.tables import FORMATS as TABLE_FORMATS
from smetric.trace.load import FORMATS, count_units, load_trace
from smetric.trace.schema import Trace


class SmetricGroup(ProseGroup):
    """The ``smetric`` group: whatever a command raises ends as bad input or as a bug."""

    def invoke(self, ctx: Any) -> Any:
        with user_errors():
            return super().invoke(ctx)


app = typer.Typer(
    help=(
        "SMetric: balanced session-centric scheduling for agentic LLM serving.\n\n"
        "Route agent traffic across engines (serve; engine and demo run it without GPUs), "
        "simulate a cluster under every routing policy (simulate, sweep), study a trace's "
        "KV reuse (analyze), size a cluster for a trace (plan), inspect and convert traces "
        "(trace)."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    cls=SmetricGroup,
)
trace_app = typer.Typer(help="Inspect and convert request traces.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")

console = Console()
__all__ = ["err_console", "user_errors"]


@app.callback()
def _root(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            envvar="SMETRIC_DEBUG",
            help="Let an internal error's traceback through, for a bug report.",
        ),
    ] = False,
) -> None:
    """Options every command shares."""
    Debug.on = debug


TraceArg = Annotated[
    str,
    typer.Argument(
        help="Trace file or folder (WEKA folder, Mooncake/Bailian .jsonl, Azure .csv, "
        "SMetric .parquet, a folder recorded by serve --record), or sample:weka / "
        "sample:mooncake for the embedded samples."
    ),
]
TraceFormatOpt = Annotated[
    str | None,
    typer.Option("--trace-format", help=f"Trace format, if not detected: {', '.join(FORMATS)}."),
]
# How a command prints its tables (``report.tables``): for people, or for scripts.
TableFormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        help=f"How tables are printed: {', '.join(TABLE_FORMATS)}. A table is folded to the "
        "terminal's width and never cuts a number; csv is the main table; with json, csv or "
        "markdown only the tables go to standard output.",
    ),
]

OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Result folder.")]
JobsOpt = Annotated[
    int | None, typer.Option("--jobs", "-j", help="Worker processes [default: CPUs].", min=1)
]


def out_console(fmt: str) -> Console:
    """Where a command's other lines go: with the tables, or out of their way on stderr
    when the tables are for a script."""
    return console if fmt == "table" else err_console


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


def load_with_progress(source: str, fmt: str | None) -> Trace:
    with progress_bar() as progress:
        task = progress.add_task(f"loading {source}", total=count_units(source))
        trace = load_trace(source, fmt, progress=lambda n: progress.advance(task, n))
    return trace


def slug(name: str) -> str:
    """A trace name made safe for a folder name."""
    return safe_name(name, "trace")
