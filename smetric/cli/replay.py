"""``smetric replay``: a trace's sessions against a live OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from smetric.cli.app import (
    TableFormatOpt,
    app,
    console,
    load_with_progress,
    out_console,
    progress_bar,
    slug,
    user_errors,
)
from smetric.replay import Progress, Replayer, ReplayOptions
from smetric.report.run_tables import results_table
from smetric.report.tables import check_format, emit
from smetric.trace.load import DEFAULT_SAMPLE


class Arrivals(StrEnum):
    closed_loop = "closed-loop"
    recorded = "recorded"


@app.command()
def replay(
    url: Annotated[str, typer.Argument(help="OpenAI-compatible base URL (router or engine).")],
    source: Annotated[
        str, typer.Option("--trace", "-t", help="Session trace to draw from.")
    ] = DEFAULT_SAMPLE,
    rate: Annotated[float, typer.Option(help="Session starts per second.", min=0.001)] = 1.0,
    duration: Annotated[float, typer.Option(help="Seconds to offer load.", min=0.1)] = 60.0,
    time_scale: Annotated[
        float, typer.Option(help="Trace seconds per replay second.", min=0.001)
    ] = 1.0,
    token_scale: Annotated[
        float, typer.Option(help="Trace tokens per prompt byte (or token).", min=0.001)
    ] = 1.0,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at most.", min=1)] = 256,
    arrivals: Annotated[
        Arrivals,
        typer.Option(
            help="closed-loop: sessions start at --rate and each turn follows its parent's "
            "answer after the recorded think time; recorded: every request at the trace's own "
            "arrival time (traces with a clock: mooncake, bailian, azure), --rate unused."
        ),
    ] = Arrivals.closed_loop,
    sample: Annotated[
        float,
        typer.Option(
            help="Recorded arrivals: fraction of sessions kept, seeded (the paper's load "
            "scaling; --time-scale compresses the clock instead).",
            min=1e-6,
            max=1.0,
        ),
    ] = 1.0,
    model: Annotated[
        str | None, typer.Option(help="Model name [default: the first the endpoint lists].")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for the sessions.")] = 0,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Result folder.", show_default=False)
    ] = None,
    table_format: TableFormatOpt = "table",
) -> None:
    """Replay a trace's sessions against an endpoint and measure them.

    Closed loop by default (time scale compresses think times, rate sets session starts);
    --arrivals recorded replays a clocked trace open loop (time scale compresses its clock).

    Writes requests-replay.parquet and summary.json in the simulator's layout, so a
    measured run compares with `smetric simulate` [default folder:
    smetric-out/replay-TRACE]. Ctrl-C stops early and keeps what was measured.
    """
    with user_errors():
        check_format(table_format)
        trace = load_with_progress(source, None)
        options = ReplayOptions(
            url=url,
            rate=rate,
            duration_s=duration,
            time_scale=time_scale,
            token_scale=token_scale,
            concurrency=concurrency,
            arrivals=arrivals.value,
            sample=sample,
            seed=seed,
            model=model,
        )
        replayer = Replayer(trace, options)
        interrupted = False
        with progress_bar() as bar:
            task = bar.add_task(f"replaying against {url}", total=round(duration))

            def tick(progress: Progress) -> None:
                description = f"{progress.completed:,} done, {progress.failed} failed"
                bar.update(task, completed=round(progress.elapsed_s), description=description)

            try:
                asyncio.run(replayer.run(tick))
            except KeyboardInterrupt:
                interrupted = True
        out = out or Path("smetric-out") / f"replay-{slug(trace.name)}"
        summary = replayer.write(out)
    title = f"{trace.name} against {url}" + (" (interrupted)" if interrupted else "")
    emit([results_table(title, {"replay": summary})], table_format, console)
    out_console(table_format).print(f"\nwrote {out}/ (summary.json, requests-replay.parquet)")
    if interrupted:
        raise typer.Exit(130)
