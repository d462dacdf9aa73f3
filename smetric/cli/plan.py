"""``smetric plan``: the fewest instances and the global tier a trace needs within SLO."""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Annotated

import typer

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
from smetric.cli.settings_options import Given, setting_flags, with_setting_flags
from smetric.cli.sim_options import (
    ConfigOpt,
    PlotsOpt,
    PoliciesOpt,
    SourceArg,
    command_config,
    sim_flags,
)
from smetric.core.errors import UserError
from smetric.core.settings_load import read_yaml
from smetric.eval.plan import PlanSettings, plan_summary, search_plan
from smetric.report.results import write_plan
from smetric.report.run_tables import plan_table
from smetric.report.tables import print_table
from smetric.sim.config import global_levels
from smetric.sim.knee import KneeSettings
from smetric.sim.parallel import RunStore, default_jobs


def _file_workload_keys(config: Path | None) -> set[str]:
    """The workload keys a config file gives (read already by ``command_config``, so valid)."""
    data = read_yaml(config) if config is not None else None
    return set((data or {}).get("workload") or {})


# The plan's own flags, and the knee search's but --start (the trace's own load).
PLAN_FLAGS = (
    *setting_flags(PlanSettings, "plan", panel="Plan"),
    *(
        flag
        for flag in setting_flags(
            KneeSettings,
            "knee",
            panel="Knee search",
            names={"max_probes": ("--max-probes", "--probes")},
        )
        if flag.field != "start"
    ),
)


@app.command()
@with_setting_flags((*sim_flags("plan"), *PLAN_FLAGS))
def plan(
    given: Given,
    source: SourceArg = None,
    config_path: ConfigOpt = None,
    policies: PoliciesOpt = None,
    provisionings: Annotated[
        str,
        typer.Option(
            "--globals", help="Comma-separated global tiers to try, smallest first: none, 1x, full."
        ),
    ] = ",".join(PlanSettings.globals),
    out: OutOpt = None,
    jobs: JobsOpt = None,
    plots: PlotsOpt = True,
) -> None:
    """Size a cluster for a trace: per policy, the fewest instances (and the smallest
    global tier with them) that serve the trace's own load within SLO.

    A count serves the trace when its knee (the load where TPS within SLO peaks, searched
    from the trace's load up) is at or past the trace's load, and --attainment of the
    requests meet both SLOs there. Counts double from --min-instances until one serves,
    then are bisected. A trace with a clock (a recording, Mooncake, Bailian, Azure) is
    replayed at its recorded arrivals over its whole span unless --duration says
    otherwise; one without is offered sessions at --rate. Writes plan.json, plan.png (TPS
    within SLO against instances) and every run in OUT/runs/, so asking again simulates
    only what is new (default folder: smetric-out/plan-TRACE).
    """
    with user_errors():
        base = command_config(given, config_path, source, policies)
        trace = load_with_progress(base.workload.trace, base.workload.format)
        in_file = _file_workload_keys(config_path)
        if "workload.open_loop" not in given and "open_loop" not in in_file:
            base = base.override("workload", open_loop=trace.has_clock)
        given_duration = "workload.duration_s" in given or "duration_s" in in_file
        if base.workload.open_loop and not given_duration:
            last = typing.cast(float | None, trace.requests["arrival_s"].max())
            span = float(last or 0.0) / base.workload.speed
            base = base.override("workload", duration_s=float(max(math.ceil(span) + 1, 2)))
        if base.warmup_s >= base.workload.duration_s:
            raise UserError(f"--warmup {base.warmup_s:g} must be shorter than the duration")
        settings = PlanSettings(
            globals=tuple(global_levels(provisionings)),
            knee=KneeSettings(**given.section("knee")),
            **given.section("plan"),
        )
        out = out or Path("smetric-out") / f"plan-{slug(trace.name)}"
        store = RunStore(out / "runs")
        processes = jobs or default_jobs(
            len(base.policies) * len(settings.globals) * settings.seeds
        )
        with progress_bar() as bar:
            task = bar.add_task("planning", total=None)

            def on_round(round_: int, runs: int) -> None:
                bar.update(task, description=f"knee searches: round {round_}, {runs} runs")
                bar.advance(task)

            points = search_plan(base, trace, settings, processes, store, on_round)
        block_size = int(trace.requests["block_size"][0]) if trace.num_requests else 16
        summary = plan_summary(base, points, settings, block_size, store.written)
    write_plan(out, base, summary, plots)
    print_table(plan_table(summary), console)
    console.print(
        f"\n{store.written} runs simulated now, the rest from {out}/runs/; "
        f"wrote {out}/ (config.yaml, plan.json{', plan.png' if plots else ''})"
    )
