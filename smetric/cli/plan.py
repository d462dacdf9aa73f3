"""``smetric plan``: the fewest instances and the global tier a trace needs within SLO."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
import yaml

from smetric.cli.app import app, console, load_with_progress, progress_bar, slug, user_errors
from smetric.cli.simulate import (
    ConfigOpt,
    DurationOpt,
    GpusOpt,
    HardwareOpt,
    JobsOpt,
    KvLoadOpt,
    ModelOpt,
    OpenLoopOpt,
    OutOpt,
    PoliciesOpt,
    RateOpt,
    SourceArg,
    SpeedOpt,
    TpotOpt,
    TtftBaseOpt,
    TtftPerTokenOpt,
    WarmupOpt,
    command_config,
    global_levels,
)
from smetric.eval.plan import PlanSettings, plan_summary, search_plan
from smetric.report.tables import Column, Table, print_table
from smetric.sim.config import dump_yaml
from smetric.sim.parallel import RunStore, default_jobs


def plan_table(summary: dict) -> Table:
    priced = summary["price_per_gpu_hour"] is not None
    unit = summary["load_unit"]
    title = (
        f"Fewest instances serving the trace's load ({summary['trace_load']:g} {unit}) "
        f"with {summary['attainment']:.0%} of requests within SLO"
    )
    headers = ["instances", "GPUs", "global tier", "TPS within SLO", "SLO met"]
    headers += ["$ / M tokens"] if priced else []
    columns = (Column("policy", "left"), *(Column(h) for h in headers))
    rows, values, bold = [], [], set()
    for i, (policy, plan) in enumerate(summary["plans"].items()):
        if plan is None:
            most = summary["instances_searched"][1]
            rows.append((policy, f"> {most}", *["-"] * (len(headers) - 1)))
            values.append({"policy": policy, "instances": None})
            continue
        size = plan["global_bytes"]
        tier = plan["global"] if not size else f"{plan['global']} ({size / 1e9:,.0f} GB)"
        if policy == summary["choice"]:
            bold.add((i, 0))
        row = [
            policy,
            str(plan["instances"]),
            str(plan["gpus"]),
            tier,
            f"{plan['tps_within_slo']:,.0f}",
            f"{plan['slo_attainment']:.0%}",
        ]
        value = {
            "policy": policy,
            **{k: plan[k] for k in ("instances", "gpus", "global", "global_bytes")},
            **{k: plan[k] for k in ("tps_within_slo", "slo_attainment")},
        }
        if priced:
            cost = plan["cost_per_million_tokens"]
            row.append("-" if cost is None else f"{cost:,.3f}")
            value["cost_per_million_tokens"] = cost
        rows.append(tuple(row))
        values.append(value)
    return Table("plans", title, columns, tuple(rows), tuple(values), frozenset(bold))


def _sets_duration(config: Path | None) -> bool:
    """Whether a config file gives the workload's duration (read already, so valid)."""
    if config is None:
        return False
    data = yaml.safe_load(config.read_text()) or {}
    return "duration_s" in (data.get("workload") or {})


@app.command()
def plan(
    source: SourceArg = None,
    config_path: ConfigOpt = None,
    policies: PoliciesOpt = None,
    provisionings: Annotated[
        str,
        typer.Option(
            "--globals", help="Comma-separated global tiers to try, smallest first: none, 1x, full."
        ),
    ] = "none,1x,full",
    min_instances: Annotated[int, typer.Option(help="Fewest instances tried.", min=1)] = 1,
    max_instances: Annotated[int, typer.Option(help="Most instances tried.", min=1)] = 64,
    attainment: Annotated[
        float,
        typer.Option(
            help="Share of requests that must meet both SLOs at the trace's own load.",
            min=0.01,
            max=1.0,
        ),
    ] = 0.95,
    price: Annotated[
        float | None,
        typer.Option("--price-per-gpu-hour", help="Price of one GPU-hour, for $ per M tokens."),
    ] = None,
    seeds: Annotated[int, typer.Option(help="Seeds per probe (0, 1, ...).", min=1)] = 1,
    precision: Annotated[
        float, typer.Option(help="Knee search: bracket the knee within this factor.", min=1.01)
    ] = 1.2,
    probes: Annotated[
        int, typer.Option(help="Knee search: probes per instance count at most.", min=2)
    ] = 10,
    model: ModelOpt = None,
    hardware: HardwareOpt = None,
    gpus: GpusOpt = None,
    kv_load: KvLoadOpt = None,
    open_loop: OpenLoopOpt = None,
    speed: SpeedOpt = None,
    rate: RateOpt = None,
    duration: DurationOpt = None,
    warmup: WarmupOpt = None,
    ttft_base: TtftBaseOpt = None,
    ttft_per_token: TtftPerTokenOpt = None,
    tpot: TpotOpt = None,
    out: OutOpt = None,
    jobs: JobsOpt = None,
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
    params = locals()
    from smetric.report.simulation import write_plan_png

    with user_errors():
        base = command_config(params)
        trace = load_with_progress(base.workload.trace, base.workload.format)
        if open_loop is None:
            base = base.override("workload", open_loop=trace.has_clock)
        if base.workload.open_loop and duration is None and not _sets_duration(config_path):
            span = float(trace.requests["arrival_s"].max() or 0.0) / base.workload.speed
            base = base.override("workload", duration_s=float(max(math.ceil(span) + 1, 2)))
        if base.warmup_s >= base.workload.duration_s:
            raise ValueError(f"--warmup {base.warmup_s:g} must be shorter than the duration")
        settings = PlanSettings(
            globals=tuple(global_levels(provisionings)),
            min_instances=min_instances,
            max_instances=max_instances,
            attainment=attainment,
            seeds=tuple(range(seeds)),
            precision=precision,
            max_probes=probes,
            price_per_gpu_hour=price,
        )
        out = out or Path("smetric-out") / f"plan-{slug(trace.name)}"
        store = RunStore(out / "runs")
        processes = jobs or default_jobs(len(base.policies) * len(settings.globals) * seeds)
        with progress_bar() as bar:
            task = bar.add_task("planning", total=None)

            def on_round(round_: int, runs: int) -> None:
                bar.update(task, description=f"knee searches: round {round_}, {runs} runs")
                bar.advance(task)

            points = search_plan(base, trace, settings, processes, store, on_round)
        block_size = int(trace.requests["block_size"][0]) if trace.num_requests else 16
        summary = plan_summary(base, points, settings, block_size)
    summary["runs_simulated"] = store.written
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(base, out / "config.yaml")
    (out / "plan.json").write_text(json.dumps(summary, indent=1))
    write_plan_png(summary, out / "plan.png")
    print_table(plan_table(summary), console)
    console.print(
        f"\n{store.written} runs simulated now, the rest from {out}/runs/; "
        f"wrote {out}/ (config.yaml, plan.json, plan.png)"
    )
