"""What every ``smetric`` command shares: the app, consoles, error handling, progress."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.main
from rich.console import Console
from typer.core import TyperCommand

from smetric.cli.errors import Debug, err_console, user_errors
from smetric.cli.help import ProseGroup, prose
from smetric.report.tables import FORMATS as TABLE_FORMATS
from smetric.trace.formats import FORMATS

if TYPE_CHECKING:
    from rich.progress import Progress

    from smetric.trace.schema import Trace

# Each command's module, imported when the command runs or its help is asked for, and its
# summary for the list of commands, so that ``smetric --help`` imports no command (the
# simulator, the router and the plots take a second to import). A test checks that each
# summary is its command's own first paragraph.
COMMANDS: dict[str, tuple[str, str]] = {
    "analyze": (
        "analyze",
        "The paper's workload study (§3) on a trace: KV reuse and where it comes from.",
    ),
    "demo": (
        "demo",
        "Start mock engines and the router, drive agentic sessions through it, watch it live.",
    ),
    "engine": (
        "engine",
        "Serve vLLM's OpenAI API with a real prefix cache and the simulator's step timing.",
    ),
    "fidelity": (
        "model",
        "The performance model against every public measurement it is checked on.",
    ),
    "grid": (
        "grid",
        "Each policy's knee in every cell of trace x global tier x fetch mode x KV room, the "
        "best baseline per cell, and in how many cells each of ours is within 1 % of it or at "
        "least 5 % ahead; under the default SLO and, scoring the same runs again, a looser one.",
    ),
    "knee": ("knee", "Find every policy's knee: the load where its TPS within SLO peaks."),
    "model": (
        "model",
        "Ask the performance model directly: prefill time, decode step, KV room, tier loads.",
    ),
    "pick": (
        "pick",
        "Pick engines for an Envoy gateway (Gateway API Inference Extension protocol).",
    ),
    "plan": (
        "plan",
        "Size a cluster for a trace: per policy, the fewest instances (and the smallest global "
        "tier with them) that serve the trace's own load within SLO.",
    ),
    "replay": ("replay", "Replay a trace's sessions against an endpoint and measure them."),
    "report": (
        "report",
        "Compare runs side by side: one table and the simulator's figures for all of them.",
    ),
    "reproduce": (
        "reproduce",
        "Regenerate the paper's colocation figures (11, 12, 14-17, 25) and its published "
        "numbers beside ours, in one HTML report.",
    ),
    "serve": (
        "serve",
        "Route OpenAI-compatible traffic (chat, completions, Anthropic messages) to engines.",
    ),
    "simulate": (
        "simulate",
        "Simulate one cluster configuration under the chosen policies, side by side.",
    ),
    "sweep": (
        "simulate",
        "Offered rate x global-tier provisioning x policy (x seed), in parallel processes or "
        "on Ray.",
    ),
    "trace": ("trace", "Inspect and convert request traces."),
}


class SmetricGroup(ProseGroup):
    """The ``smetric`` group: each command loaded when it is used, and whatever a command
    raises ended as bad input or as a bug."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._summaries_only = False

    def list_commands(self, ctx: Any) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            if self._summaries_only:
                return TyperCommand(cmd_name, help=prose(COMMANDS[cmd_name][1]))
            self.commands[cmd_name] = command(cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        # The list of commands needs only their summaries.
        self._summaries_only = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._summaries_only = False

    def invoke(self, ctx: Any) -> Any:
        with user_errors():
            return super().invoke(ctx)


def command(name: str) -> Any:
    """The click command ``name``, its module imported (which registers it on ``app``)."""
    importlib.import_module(f"smetric.cli.{COMMANDS[name][0]}")
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


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
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


def load_with_progress(source: str, fmt: str | None) -> Trace:
    from smetric.trace.load import count_units, load_trace

    with progress_bar() as progress:
        task = progress.add_task(f"loading {source}", total=count_units(source))
        trace = load_trace(source, fmt, progress=lambda n: progress.advance(task, n))
    return trace


def slug(name: str) -> str:
    """A trace name made safe for a folder name."""
    from smetric.metrics.runs import safe_name

    return safe_name(name, "trace")
