"""``smetric knee``: each policy's maximum TPS within SLO, searched adaptively over load."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from smetric.cli.app import app, console, load_with_progress, progress_bar, slug, user_errors
from smetric.cli.simulate import (
    ConfigOpt,
    DecodeOpt,
    DurationOpt,
    HardwareOpt,
    InstancesOpt,
    JobsOpt,
    OutOpt,
    PoliciesOpt,
    PrefillOpt,
    SourceArg,
    WarmupOpt,
    build_config,
    global_levels,
)
from smetric.core.policy import DEFAULT_POLICY
from smetric.sim.config import SimConfig, check_kv_load, dump_yaml
from smetric.sim.knee import Knee, KneeSettings, search_knees
from smetric.sim.parallel import default_jobs

# The policies this project proposes; every other policy is a baseline.
OURS = ("smetric", "smetric_tokens", "smetric_cost")


def base_name(spec: str) -> str:
    return spec.partition(":")[0].strip()


def best_baseline(knees: dict[str, Knee]) -> tuple[str, Knee] | None:
    """The baseline with the highest knee, at its best setting (``linear:lam=0.5`` ...)."""
    rivals = {p: k for p, k in knees.items() if base_name(p) not in OURS}
    if not rivals:
        return None
    spec = max(rivals, key=lambda p: rivals[p].mean)
    return spec, rivals[spec]


def knee_summary(cells: list[tuple[str, str]], policies: tuple[str, ...], knees: dict) -> dict:
    out = []
    for glob, load in cells:
        per_policy = {p: knees[(glob, load, p)] for p in policies}
        rival = best_baseline(per_policy)
        out.append(
            {
                "global": glob,
                "kv_load": load,
                "knees": {p: dataclasses.asdict(k) for p, k in per_policy.items()},
                "best_baseline": None if rival is None else rival[0],
            }
        )
    return {"policies": list(policies), "cells": out}


def knee_rows(
    summary: dict, default: str, number: Callable[[float], str], bold: Callable[[str], str]
) -> list[list[str]]:
    """One row per policy (the best knee of each cell in bold), then the default policy's
    lead over the best baseline at its best setting."""
    rows = []
    for p in summary["policies"]:
        row = [p]
        for cell in summary["cells"]:
            k = cell["knees"][p]
            top = max(v["mean"] for v in cell["knees"].values())
            text = f"{number(k['mean'])} ± {number(k['stdev'])} (@{k['load']:.3g})"
            row.append(bold(text) if k["mean"] == top and top > 0 else text)
        rows.append(row)
    if default in summary["policies"]:
        row = [f"{default} vs best baseline"]
        for cell in summary["cells"]:
            rival = cell["best_baseline"]
            theirs = cell["knees"][rival]["mean"] if rival else 0.0
            ours = cell["knees"][default]["mean"]
            row.append(f"{(ours / theirs - 1) * 100:+.1f} % vs {rival}" if theirs else "-")
        rows.append(row)
    return rows


def knee_table(summary: dict, default: str) -> Table:
    table = Table(title="Max TPS within SLO: mean ± sd over seeds (at the knee's load)")
    table.add_column("policy")
    for cell in summary["cells"]:
        table.add_column(f"global {cell['global']}\n{cell['kv_load']} load", justify="right")
    for row in knee_rows(summary, default, lambda v: f"{v:,.0f}", lambda t: f"[bold green]{t}[/]"):
        table.add_row(*row)
    return table


def knee_markdown(summary: dict, default: str) -> str:
    """The knee table as Markdown, for the README."""
    head = [f"global {c['global']}, {c['kv_load']} load" for c in summary["cells"]]
    rows = knee_rows(summary, default, lambda v: f"{v / 1000:,.1f}k", lambda t: f"**{t}**")
    lines = ["| policy | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


@app.command()
def knee(
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
    start: Annotated[
        float,
        typer.Option(help="First load probed: sessions/s, or the open-loop speed-up.", min=1e-6),
    ] = 0.1,
    precision: Annotated[
        float, typer.Option(help="Stop when the knee is bracketed within this factor.", min=1.01)
    ] = 1.2,
    default: Annotated[
        str, typer.Option(help="The policy compared with the best baseline.")
    ] = DEFAULT_POLICY,
    instances: InstancesOpt = None,
    prefill_instances: PrefillOpt = None,
    decode_instances: DecodeOpt = None,
    hardware: HardwareOpt = None,
    duration: DurationOpt = None,
    warmup: WarmupOpt = None,
    out: OutOpt = None,
    jobs: JobsOpt = None,
) -> None:
    """Find every policy's knee: the load where its TPS within SLO peaks.

    For each global tier and load mode, each policy's load (session starts per second,
    or in open loop the replay speed-up) is stepped up by 2x until its TPS within SLO
    (mean over --seeds) stops rising, then bisected around the best probe. Baselines
    are compared at their best setting: pass several (linear:lam=0.5,linear:lam=0.9)
    and the best counts. Writes knee.json, knee.md (the table) and knee.png to --out
    (smetric-out/knee-TRACE unless given).
    """
    from smetric.report.simulation import write_knee_png

    with user_errors():
        levels = global_levels(provisionings)
        modes = [check_kv_load(m.strip()) for m in kv_loads.split(",") if m.strip()]
        base = build_config(
            config_path,
            source,
            policies=policies,
            instances=instances,
            prefill_instances=prefill_instances,
            decode_instances=decode_instances,
            hardware=hardware,
            duration=duration,
            warmup=warmup,
        )
        settings = KneeSettings(start=start, precision=precision)
        cells: dict[tuple, SimConfig] = {
            (g, m, p): dataclasses.replace(
                base.override("cluster", global_capacity=g, kv_load=m), policies=(p,)
            )
            for g in levels
            for m in modes
            for p in base.policies
        }
        trace = load_with_progress(base.workload.trace, base.workload.format)
        processes = jobs or default_jobs(len(cells) * seeds)
        with progress_bar() as bar:
            task = bar.add_task("searching knees", total=None)

            def on_round(round_: int, runs: int) -> None:
                bar.update(task, description=f"knee search: round {round_}, {runs} runs")
                bar.advance(task)

            knees = search_knees(cells, range(seeds), settings, processes, trace, on_round)
    summary = knee_summary([(g, m) for g in levels for m in modes], base.policies, knees)
    summary["seeds"] = seeds
    summary["settings"] = dataclasses.asdict(settings)
    out = out or Path("smetric-out") / f"knee-{slug(trace.name)}"
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(base, out / "config.yaml")
    (out / "knee.json").write_text(json.dumps(summary, indent=1))
    (out / "knee.md").write_text(knee_markdown(summary, default))
    write_knee_png(summary, out / "knee.png")
    console.print(knee_table(summary, default))
    console.print(f"\nwrote {out}/ (config.yaml, knee.json, knee.md, knee.png)")
