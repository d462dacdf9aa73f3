"""``smetric grid``: every policy's knee across a grid of traces and clusters, and the verdict."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Annotated

from smetric.cli.app import (
    JobsOpt,
    OutOpt,
    app,
    console,
    load_with_progress,
    progress_bar,
    slug,
    user_errors,
)
from smetric.cli.evaluation import (
    PolicyListOpt,
    check_page,
    checked_policies,
    page_option,
    preset_option,
    report_command,
)
from smetric.eval.grid import grid_cells, run_grid
from smetric.eval.grid_preset import GRID_PRESETS, load_grid_preset
from smetric.eval.reproduce import DEFAULT_POLICIES
from smetric.report.grid import grid_markdown
from smetric.report.stamp import write_results_page
from smetric.sim.config import SimConfig
from smetric.sim.parallel import RunStore, default_jobs
from smetric.trace.load import resolve
from smetric.trace.schema import Trace

# reproduce's policies but Linear at the paper's λ=0.9 (``linear``), which never leads:
# the baselines that lead somewhere in the knee searches (docs/results/) are cache-aware
# without a global tier, least-load and Linear λ=0.3 at 1x and full, LMetric close behind.
POLICY_LIST = ",".join(p for p in DEFAULT_POLICIES if p != "linear")
GRID_INTRO = """\
Each policy's knee (its maximum TPS within SLO over offered load) in every cell of trace x
global tier x global-tier fetch mode x KV room, and per cell the best baseline at its best
setting. A policy of the SMetric family counts as level with the best baseline within 1 %
of it and as ahead at 5 % or more. How to run it and read it:
[Simulate, sweep, knee, grid and reproduce](../guides/simulate.md#the-policy-grid)."""
ROBUSTNESS_INTRO = """\
The same knee searches with the simulated engines changed behind the policies' backs:
the global tier slower, prefill slower, KV room smaller or larger, while what each policy
is told of the hardware stays as configured. A lead that the performance model's own
error bars could erase shows here. How to run it and read it:
[Robustness](../guides/simulate.md#robustness-worlds-the-policies-are-not-told-about);
how the default policy copes: [learned prices](../concepts/learned-prices.md)."""


@app.command(name="grid")
def grid_command(
    preset: Annotated[str, preset_option(GRID_PRESETS)] = "grid-quick",
    policies: PolicyListOpt = POLICY_LIST,
    out: OutOpt = None,
    page: Annotated[Path | None, page_option("grid.md")] = None,
    jobs: JobsOpt = None,
) -> None:
    """Each policy's knee in every cell of trace x global tier x fetch mode x KV room,
    the best baseline per cell, and in how many cells each of ours is within 1 % of it
    or at least 5 % ahead; under the default SLO and, scoring the same runs again, a
    looser one.

    Writes grid.json and grid.md to --out (default smetric-out/grid-PRESET). Every run
    is kept in OUT/runs/ID/, so running again, or with one more policy, runs only what
    is missing.
    """
    command = report_command("grid", ["--preset", preset], policies, POLICY_LIST)
    started, cpu = time.monotonic(), _cpu_s()
    with user_errors():
        chosen = load_grid_preset(preset)
        specs = checked_policies(policies)
        check_page(page)
        for trace in chosen.traces.values():  # a missing trace fails now, not an hour in
            resolve(trace.config.workload.trace)
        out = out or Path("smetric-out") / f"grid-{slug(chosen.name)}"
        store = RunStore(out / "runs")
        cells = len(grid_cells(chosen)) // len(chosen.traces)
        processes = jobs or default_jobs(cells * len(specs) * chosen.seeds)

        def load(config: SimConfig) -> Trace:
            return load_with_progress(config.workload.trace, config.workload.format)

        with progress_bar() as bar:
            task = bar.add_task("grid", total=None)

            def on_round(trace: str, round_: int, runs: int) -> None:
                bar.update(task, description=f"{trace}: knee search round {round_}, {runs} runs")
                bar.advance(task)

            result = run_grid(chosen, specs, load, store, processes, on_round)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(result.to_json())
    markdown = out / "grid.md"
    markdown.write_text(grid_markdown(result, command))
    if page is not None:
        with user_errors():
            intro = ROBUSTNESS_INTRO if len(chosen.worlds) > 1 else GRID_INTRO
            write_results_page(page, chosen.page_title, markdown.read_text(), command, intro)
    console.print(markdown.read_text(), markup=False, highlight=False, soft_wrap=True)
    console.print(
        f"simulated {store.written} runs in {time.monotonic() - started:,.0f} s wall, "
        f"{_cpu_s() - cpu:,.0f} CPU-s (this process and its workers)\nwrote {out}/ "
        "(grid.json, grid.md)" + (f"\nwrote {page}" if page is not None else "")
    )


def _cpu_s() -> float:
    """User + system CPU of this process and its finished worker processes."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
