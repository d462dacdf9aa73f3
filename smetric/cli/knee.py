"""``smetric knee``: each policy's maximum TPS within SLO, searched adaptively over load."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from smetric.cli.app import (
    JobsOpt,
    OutOpt,
    TableFormatOpt,
    app,
    console,
    load_with_progress,
    out_console,
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
from smetric.core.policies import DEFAULT_POLICY
from smetric.report.results import write_knee
from smetric.report.run_tables import knee_table
from smetric.report.tables import check_format, emit
from smetric.sim.config import SimConfig, check_kv_load, global_levels
from smetric.sim.knee import KneeSettings, knee_summary, search_knees
from smetric.sim.parallel import RunStore, default_jobs

# The knee search's own flags: --start, --grow, --precision, --max-probes.
SEARCH_FLAGS = setting_flags(KneeSettings, "knee", panel="Knee search")


@app.command()
@with_setting_flags((*sim_flags("knee"), *SEARCH_FLAGS))
def knee(
    given: Given,
    source: SourceArg = None,
    config_path: ConfigOpt = None,
    policies: PoliciesOpt = None,
    provisionings: Annotated[
        str, typer.Option("--globals", help="Comma-separated global tiers: none, 1x, 1.6x, full.")
    ] = "none,1x,full",
    kv_loads: Annotated[
        str, typer.Option("--kv-loads", help="Comma-separated global-tier load modes: sync, async.")
    ] = "sync",
    seeds: Annotated[int, typer.Option(help="Seeds per probe (0, 1, ...).", min=1)] = 2,
    default: Annotated[
        str, typer.Option(help="The policy compared with the best baseline.")
    ] = DEFAULT_POLICY,
    out: OutOpt = None,
    jobs: JobsOpt = None,
    plots: PlotsOpt = True,
    table_format: TableFormatOpt = "table",
) -> None:
    """Find every policy's knee: the load where its TPS within SLO peaks.

    For each global tier and load mode, each policy's load (session starts per second,
    or in open loop the replay speed-up) is stepped up by --grow from --start until its
    TPS within SLO (mean over --seeds) stops rising, then bisected around the best probe.
    Baselines are compared at their best setting: pass several
    (linear:lam=0.5,linear:lam=0.9) and the best counts. Writes knee.json, knee.md (the
    table) and knee.png to --out (smetric-out/knee-TRACE unless given); every probe is
    kept in OUT/runs/ID/, so running the same command again runs only what is missing.
    """
    with user_errors():
        check_format(table_format)
        levels = global_levels(provisionings)
        modes = [check_kv_load(m.strip()) for m in kv_loads.split(",") if m.strip()]
        base = command_config(given, config_path, source, policies)
        settings = KneeSettings(**given.section("knee"))
        cells: dict[tuple, SimConfig] = {
            (g, m, p): dataclasses.replace(
                base.override("cluster", global_capacity=g, kv_load=m), policies=(p,)
            )
            for g in levels
            for m in modes
            for p in base.policies
        }
        trace = load_with_progress(base.workload.trace, base.workload.format)
        out = out or Path("smetric-out") / f"knee-{slug(trace.name)}"
        processes = jobs or default_jobs(len(cells) * seeds)
        with progress_bar() as bar:
            task = bar.add_task("searching knees", total=None)

            def on_round(round_: int, runs: int) -> None:
                bar.update(task, description=f"knee search: round {round_}, {runs} runs")
                bar.advance(task)

            store = RunStore(out / "runs")
            knees = search_knees(cells, range(seeds), settings, processes, trace, on_round, store)
    searched = [(g, m) for g in levels for m in modes]
    summary = knee_summary(searched, base.policies, knees, seeds, settings)
    write_knee(out, base, summary, default, plots)
    emit([knee_table(summary, default)], table_format, console)
    png = ", knee.png" if plots else ""
    out_console(table_format).print(f"\nwrote {out}/ (config.yaml, knee.json, knee.md{png})")
