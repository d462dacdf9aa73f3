"""``smetric simulate`` and ``smetric sweep``: the paper's evaluation on a simulated cluster."""

from __future__ import annotations

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
from smetric.cli.settings_options import Given, with_setting_flags
from smetric.cli.sim_options import (
    ConfigOpt,
    PlotsOpt,
    PoliciesOpt,
    SourceArg,
    command_config,
    sim_flags,
)
from smetric.report.results import (
    hardware_lines,
    run_title,
    tps_meaning,
    write_simulation,
    write_sweep,
)
from smetric.report.run_tables import (
    branches_table,
    disaggregation_table,
    results_table,
    sweep_table,
)
from smetric.report.tables import check_format, emit
from smetric.sim.config import global_levels
from smetric.sim.jobs import Job
from smetric.sim.parallel import RunStore, default_jobs, run_jobs, run_sweep
from smetric.sim.result import RunResult
from smetric.sim.sweep import parse_rates, sweep_cells, sweep_jobs, sweep_summary


@app.command()
@with_setting_flags(sim_flags("simulate"))
def simulate(
    given: Given,
    source: SourceArg = None,
    config_path: ConfigOpt = None,
    policies: PoliciesOpt = None,
    out: OutOpt = None,
    jobs: JobsOpt = None,
    plots: PlotsOpt = True,
    table_format: TableFormatOpt = "table",
) -> None:
    """Simulate one cluster configuration under the chosen policies, side by side.

    Writes the resolved configuration, a summary JSON, one per-request Parquet table per
    policy and plots to the result folder [default: smetric-out/simulate-TRACE].
    """
    with user_errors():
        check_format(table_format)
        config = command_config(given, config_path, source, policies)
        trace_source = config.workload.trace
        trace = load_with_progress(trace_source, config.workload.format)
        runs = [Job((p,), config, p) for p in config.policies]
        processes = jobs or default_jobs(len(runs))
        results: dict[str, RunResult] = {}
        with progress_bar() as bar:
            task = bar.add_task(f"simulating {len(runs)} policies", total=len(runs))
            for key, result in run_jobs(
                trace_source, config.workload.format, runs, processes, trace
            ):
                results[key[0]] = result
                bar.advance(task)
    ordered = {p: results[p] for p in config.policies}
    out = out or Path("smetric-out") / f"simulate-{slug(trace.name)}"
    drawn = write_simulation(out, config, ordered, plots)
    shape = next(iter(ordered.values())).shape
    summaries = {policy: result.summary for policy, result in ordered.items()}
    tables = [results_table(run_title(config, shape), summaries), branches_table(summaries)]
    if config.cluster.prefill_instances:
        tables.append(disaggregation_table(summaries))
    emit(tables, table_format, console)
    notes = out_console(table_format)
    first = next(iter(ordered.values())).summary.requests
    notes.print(
        f"TPS@SLO: {tps_meaning(config)} · "
        f"{first.rejected} requests longer than max_model_len "
        f"({shape.max_model_len:,}) rejected"
    )
    for line in hardware_lines(ordered):
        notes.print(line)
    notes.print(f"\nwrote {out}/ (config.yaml, summary.json, requests-*.parquet, {drawn} plots)")


RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        metavar="ADDRESS",
        help="Run on a Ray cluster instead of local processes: 'auto' (the cluster this "
        "machine belongs to, after `ray start`), HOST:PORT of its head, ray://HOST:10001, or "
        "'local' (a one-machine cluster for this sweep). Needs: pip install 'smetric\\[ray]'.",
    ),
]


@app.command()
@with_setting_flags(sim_flags("sweep"))
def sweep(
    given: Given,
    source: SourceArg = None,
    config_path: ConfigOpt = None,
    rates: Annotated[
        str, typer.Option(help="Comma-separated session rates (sessions/s) to offer.")
    ] = "0.1,0.2,0.4,0.8",
    provisionings: Annotated[
        str,
        typer.Option(
            "--globals", help="Comma-separated global-tier capacities: none, 1x, 1.6x, full."
        ),
    ] = "none,1x,full",
    policies: PoliciesOpt = None,
    out: OutOpt = None,
    jobs: JobsOpt = None,
    ray: RayOpt = None,
    seeds: Annotated[
        int,
        typer.Option(
            min=1,
            help="Run every cell with seeds SEED..SEED+N-1 and report each cell's mean and "
            "standard deviation over them; a policy's max TPS is the best rate on its mean "
            "curve.",
        ),
    ] = 1,
    plots: PlotsOpt = True,
    table_format: TableFormatOpt = "table",
) -> None:
    """Offered rate x global-tier provisioning x policy (x seed), in parallel processes or
    on Ray.

    Reports each policy's maximum TPS within SLO per provisioning (the paper's Figures
    11a/16a) and writes sweep.json and plots [default: smetric-out/sweep-TRACE]. Each
    finished run is kept in OUT/runs/ID/ (its resolved config.yaml and summary.json), so
    running the same command again after an interruption runs only what is missing; a
    changed setting is a different run (the trace counts by its path). Delete OUT/runs to
    start over. With --seeds N each seed is its own run there, so a sweep with more seeds
    reuses the runs of one with fewer.
    """
    with user_errors():
        check_format(table_format)
        rate_values = parse_rates(rates)
        levels = global_levels(provisionings)
        base = command_config(given, config_path, source, policies)
        runs = sweep_jobs(base, rate_values, levels, seeds)
        trace = load_with_progress(base.workload.trace, base.workload.format)
        out = out or Path("smetric-out") / f"sweep-{slug(trace.name)}"
        title = f"sweeping {len(runs)} runs"
        with progress_bar() as bar:
            task = bar.add_task(title, total=len(runs))

            def show(done: int, inflight: dict[str, int]) -> None:
                where = ", ".join(f"{node} {n}" for node, n in sorted(inflight.items()))
                text = f"{title} · in flight: {where}" if where else title
                bar.update(task, completed=done, description=text)

            results, ran = run_sweep(
                runs,
                RunStore(out / "runs"),
                trace,
                processes=jobs or default_jobs(len(runs)),
                ray_address=ray,
                progress=show,
            )
    summary = sweep_summary(rate_values, levels, base.policies, sweep_cells(runs, results))
    drawn = write_sweep(out, base, summary, plots)
    emit([sweep_table(summary)], table_format, console)
    reused = f", {len(runs) - ran} of {len(runs)} runs reused from runs/" if ran < len(runs) else ""
    notes = out_console(table_format)
    notes.print(f"\nwrote {out}/ (config.yaml, sweep.json, {drawn} plots{reused})")
