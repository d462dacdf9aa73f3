"""``smetric reproduce``: the paper's colocation evaluation in one command."""

from __future__ import annotations

import dataclasses
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
from smetric.cli.sim_options import SourceArg
from smetric.eval.paper import is_large_model
from smetric.eval.paper import title as paper_title
from smetric.eval.preset import PRESETS, load_preset
from smetric.eval.reproduce import DEFAULT_POLICIES, paper_load_runs, reproduce
from smetric.report.reproduce import write_report
from smetric.report.stamp import write_results_page
from smetric.sim.parallel import RunStore, default_jobs

POLICY_LIST = ",".join(DEFAULT_POLICIES)
INTRO = """\
The paper's colocation evaluation (its Figures 11, 12, 14-17 and 25) regenerated on a
simulated cluster, with the paper's published numbers beside ours. The figures are in
`report.html` in the command's output folder. How to run it and what each part measures:
[Simulate, sweep, knee, grid and reproduce](../guides/simulate.md)."""
LARGE_INTRO = """\
The paper's larger-model evaluation (its Figures 18-20: Qwen3-235B-A22B-FP8 on 8
instances of 4 H20s) regenerated on a simulated cluster, with the paper's published
numbers beside ours. The sections below carry the 30B evaluation's figure numbers; the
same figures are Figures 18-20 for this model. How to run it:
[Simulate, sweep, knee, grid and reproduce](../guides/simulate.md)."""


@app.command(name="reproduce")
def reproduce_command(
    source: SourceArg = None,
    preset: Annotated[str, preset_option(PRESETS)] = "quick",
    policies: PolicyListOpt = POLICY_LIST,
    out: OutOpt = None,
    page: Annotated[Path | None, page_option("validation.md")] = None,
    jobs: JobsOpt = None,
) -> None:
    """Regenerate the paper's colocation figures (11, 12, 14-17, 25) and its published
    numbers beside ours, in one HTML report.

    Runs each policy's knee search per global tier, a rate sweep on the full tier, the
    runs at 1.5x load (latency CDFs, imbalance, stickiness), SMetric without its overload
    guard and its OVERLOAD / HIT_RATIO sensitivity. Writes report.html (figures embedded),
    validation.md, reproduce.json and the PNGs to --out (default:
    smetric-out/reproduce-PRESET-TRACE). Every finished run is kept in OUT/runs/ID/, so
    running the command again runs only what is missing.
    """
    words = [source] if source else []
    command = report_command("reproduce", [*words, "--preset", preset], policies, POLICY_LIST)
    with user_errors():
        chosen = load_preset(preset)
        specs = checked_policies(policies)
        if source is not None:
            chosen = dataclasses.replace(
                chosen, config=chosen.config.override("workload", trace=source)
            )
        check_page(page)
        trace = load_with_progress(chosen.config.workload.trace, chosen.config.workload.format)
        out = out or Path("smetric-out") / f"reproduce-{slug(chosen.name)}-{slug(trace.name)}"
        store = RunStore(out / "runs")
        # Runs per knee-search round, the widest phase: every tier, policy and seed at once.
        searches = len(specs) * len(chosen.tiers) * chosen.seeds
        with progress_bar() as bar:
            task = bar.add_task("reproducing", total=None)

            def progress(what: str, done: int, total: int | None) -> None:
                bar.update(task, description=what, completed=done, total=total)

            result = reproduce(
                trace, chosen, specs, store, jobs or default_jobs(searches), progress
            )
        summaries, tables = paper_load_runs(store, chosen, specs, result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reproduce.json").write_text(result.to_json())
    html, markdown = write_report(result, summaries, tables, command, out)
    if page is not None:
        with user_errors():
            intro = LARGE_INTRO if is_large_model(result) else INTRO
            write_results_page(page, paper_title(result), markdown.read_text(), command, intro)
    reused = "" if store.written else " (every run reused from runs/)"
    console.print(
        f"simulated {store.written} runs{reused}\nwrote {html}, {markdown}, reproduce.json "
        "and the figures" + (f"\nwrote {page}" if page is not None else "")
    )
