"""``smetric demo``: mock engines + the router + agentic sessions, live, on loopback."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.live import Live
from rich.table import Table

from smetric.cli.app import app, console, load_with_progress, user_errors
from smetric.core.policies import DEFAULT_POLICY, POLICY_NAMES
from smetric.demo import DemoOptions, DemoState, run_demo
from smetric.trace.load import DEFAULT_SAMPLE


def engine_table(state: DemoState, title: str) -> Table:
    table = Table(title=title, title_style="bold")
    for column in ("engine", "in flight", "requests", "prompt tokens", "cached"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    router = state.router
    loads = {e.url: e.inflight for e in router.engines} if router else {}
    for url, tally in state.tallies().items():
        ratio = tally.cached_tokens / tally.prompt_tokens if tally.prompt_tokens else 0.0
        table.add_row(
            url.removeprefix("http://"),
            str(loads.get(url, 0)),
            f"{tally.requests:,}",
            f"{tally.prompt_tokens:,}",
            f"{ratio:.0%}",
        )
    return table


def branch_counts(state: DemoState) -> dict[str, float]:
    if state.router is None:
        return {}
    registry = state.router.metrics.registry
    counts = {}
    for branch in state.router.core.policy.branches:
        value = registry.get_sample_value("smetric_routing_decisions_total", {"branch": branch})
        counts[branch] = value or 0.0
    return counts


@app.command()
def demo(
    source: Annotated[str, typer.Argument(help="Session trace to draw from.")] = DEFAULT_SAMPLE,
    engines: Annotated[int, typer.Option(help="Mock engines to start.", min=1, max=64)] = 4,
    policy: Annotated[
        str, typer.Option("--policy", "-p", help=f"One of {', '.join(POLICY_NAMES)}.")
    ] = DEFAULT_POLICY,
    rate: Annotated[float, typer.Option(help="Session starts per second.", min=0.01)] = 2.0,
    duration: Annotated[float, typer.Option(help="Seconds to run.", min=1.0)] = 20.0,
    seed: Annotated[int, typer.Option(help="Seed for the sessions.")] = 0,
) -> None:
    """Start mock engines and the router, drive agentic sessions through it, watch it live.

    Shows per-engine load and cache-hit ratio while it runs and the routing branches at
    the end. Everything runs in this process: Ctrl-C stops it and leaves nothing behind.
    """
    with user_errors():
        trace = load_with_progress(source, None)
        options = DemoOptions(
            engines=engines, policy=policy, session_rate=rate, duration_s=duration, seed=seed
        )
        title = f"{policy} over {engines} mock engines"
        with Live(console=console, refresh_per_second=4, transient=False) as live:

            def tick(state: DemoState) -> None:
                live.update(engine_table(state, title))

            try:
                state = asyncio.run(run_demo(trace, options, tick))
            except KeyboardInterrupt:
                console.print("stopped")
                raise typer.Exit(130) from None
    counts = branch_counts(state)
    total = sum(counts.values()) or 1.0
    summary = " · ".join(f"{b} {n / total:.0%}" for b, n in counts.items() if n)
    progress = state.replayer.progress if state.replayer else None
    sent, failed = (progress.sent, progress.failed) if progress else (0, 0)
    console.print(f"\n{sent:,} requests sent, {failed} failed; branches: {summary}")
