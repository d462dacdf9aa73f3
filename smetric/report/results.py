"""What the simulation commands leave in their result folder, and the lines that explain
their tables.

Every folder starts with the resolved ``config.yaml``, so any number in it can be
reproduced with ``smetric simulate --config OUT/config.yaml`` (or the same command).
The plots are drawn by ``report.simulation``, imported only when plots are drawn, so that
a command's ``--help`` and a ``--no-plots`` run never load matplotlib.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from smetric.core.policies import base_name, hardware_params
from smetric.metrics.results import KneeSummary, PlanResult, SweepResult, write_summaries
from smetric.metrics.runs import run_file_name
from smetric.report.knee import knee_markdown
from smetric.sim.config import SimConfig, dump_yaml
from smetric.sim.result import RunResult


def _start(out: Path, config: SimConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(config, out / "config.yaml")


def write_simulation(
    out: Path, config: SimConfig, results: Mapping[str, RunResult], plots: bool = True
) -> int:
    """Configuration, summaries, per-request tables and plots; returns the plot count."""
    _start(out, config)
    shape = next(iter(results.values())).shape
    meta = {
        "cluster_shape": vars(shape),
        "policies": None,
        "policy_params": {policy: r.policy_params for policy, r in results.items()},
    }
    write_summaries(out / "summary.json", meta, {p: r.summary for p, r in results.items()})
    for policy, result in results.items():
        result.requests.write_parquet(out / run_file_name(policy))
    if not plots:
        return 0
    from smetric.report.simulation import write_simulation_pngs

    summaries = {policy: r.summary for policy, r in results.items()}
    tables = {policy: r.requests for policy, r in results.items()}
    return len(write_simulation_pngs(summaries, tables, out))


def write_sweep(out: Path, config: SimConfig, summary: SweepResult, plots: bool = True) -> int:
    """Configuration, sweep.json and plots; returns the plot count."""
    _start(out, config)
    (out / "sweep.json").write_text(summary.to_json())
    if not plots:
        return 0
    from smetric.report.simulation import sweep_figures, write_sweep_pngs

    return len(write_sweep_pngs(sweep_figures(summary), out))


def write_knee(
    out: Path, config: SimConfig, summary: KneeSummary, default: str, plots: bool = True
) -> None:
    """Configuration, knee.json, knee.md (``default`` against the best baseline), knee.png."""
    _start(out, config)
    (out / "knee.json").write_text(summary.to_json())
    (out / "knee.md").write_text(knee_markdown(summary, (default,)))
    if plots:
        from smetric.report.simulation import write_knee_png

        write_knee_png(summary, out / "knee.png")


def write_plan(out: Path, config: SimConfig, summary: PlanResult, plots: bool = True) -> None:
    """Configuration, plan.json and plan.png."""
    _start(out, config)
    (out / "plan.json").write_text(summary.to_json())
    if plots:
        from smetric.report.simulation import write_plan_png

        write_plan_png(summary, out / "plan.png")


def hardware_lines(results: Mapping[str, RunResult]) -> list[str]:
    """What each policy assumed of the hardware, where the simulator derived it, and
    what it learned from its requests, where it learns."""
    lines = []
    for policy, result in results.items():
        derived = hardware_params(base_name(policy))
        if derived:
            values = ", ".join(f"{k}={result.policy_params[k]:g}" for k in derived)
            lines.append(f"{policy} assumed {values}")
        learned = result.summary.learned_params
        if learned:
            values = ", ".join(f"{k}={v:.3g}" for k, v in learned.items())
            count = result.summary.learned_from
            lines.append(f"{policy} learned {values} from {count:,} requests")
    return lines


def tps_meaning(config: SimConfig) -> str:
    """What TPS within SLO counts in this cluster's mode (colocated, prefill only, PD)."""
    cluster = config.cluster
    if not cluster.prefill_instances:
        return "prompt + output tokens/s of requests that met both SLOs"
    if not cluster.decode_instances:
        return "prompt tokens/s of requests that met the TTFT SLO (prefill only)"
    return "prompt tokens/s of requests that met both SLOs (TTFT after the KV pull)"


def run_title(config: SimConfig, shape: Any) -> str:
    """The results table's title: the cluster, its KV room and the load it was offered."""
    c, w = config.cluster, config.workload
    load = "open loop" if w.open_loop else f"{w.session_rate:g} sessions/s"
    size = f"{c.instances}"
    if c.prefill_instances:
        size = f"{c.prefill_instances} prefill + {c.decode_instances} decode"
    return (
        f"{size} x {c.gpus_per_instance}x{c.hardware} · {c.model} · "
        f"KV {shape.kv_capacity_tokens:,} tokens/instance · global {c.global_capacity} · "
        f"{load} for {w.duration_s:g} s"
    )
