"""The tables of simulated and measured runs (``simulate``, ``sweep``, ``knee``, ``report``,
``replay``), built from their summaries once for people and scripts alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smetric.metrics.results import (
    KneeSummary,
    Percentiles,
    PlanResult,
    RunSummary,
    SweepResult,
)
from smetric.report.knee import knee_rows
from smetric.report.tables import Column, Table

QUANTILES = ("p50", "p90", "p99")
STICKINESS = ("session", "agent", "turn")


def _num(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}"


def _three(values: Percentiles, scale: float = 1.0, digits: int = 1) -> str:
    return "/".join(_num(v, scale, digits) for v in (values.p50, values.p90, values.p99))


def results_table(title: str, summaries: Mapping[str, RunSummary]) -> Table:
    """One row per run summary (a simulated policy or a measured replay), best TPS bold."""
    columns = (
        Column("policy", "left"),
        Column("TPS\n@SLO"),
        Column("SLO\nmet"),
        Column("TTFT s\np50/p90/p99"),
        Column("TPOT ms\np50/p90/p99"),
        Column("hit %\nL/G"),
        Column("imba-\nlance"),
        Column("sticky %\nsess/agent/turn"),
    )
    best = max((s.tps_within_slo for s in summaries.values()), default=0.0)
    rows, values, bold = [], [], set()
    for i, (policy, s) in enumerate(summaries.items()):
        ttft, tpot, reuse = s.ttft_s.to_builtins(), s.tpot_s.to_builtins(), s.reuse
        sticky = s.stickiness.to_builtins()
        rows.append(
            (
                policy,
                f"{s.tps_within_slo:,.0f}",
                f"{s.slo_attainment:.0%}",
                _three(s.ttft_s, 1, 2),
                _three(s.tpot_s, 1000, 0),
                f"{reuse.local * 100:.0f}/{reuse.global_ * 100:.0f}",
                f"{s.imbalance.mean:.2f}x",
                "/".join(_pct(sticky[k]) for k in STICKINESS),
            )
        )
        if s.tps_within_slo == best and best > 0:
            bold.add((i, 1))
        values.append(
            {
                "policy": policy,
                "tps_within_slo": s.tps_within_slo,
                "slo_attainment": s.slo_attainment,
                **{f"ttft_{p}_s": ttft[p] for p in QUANTILES},
                **{f"tpot_{p}_s": tpot[p] for p in QUANTILES},
                "hit_local": reuse.local,
                "hit_global": reuse.global_,
                "imbalance_mean": s.imbalance.mean,
                **{f"sticky_{k}": sticky[k] for k in STICKINESS},
            }
        )
    return Table("runs", title, columns, tuple(rows), tuple(values), frozenset(bold))


def branches_table(summaries: Mapping[str, RunSummary]) -> Table:
    """Why each policy routed where it did: decisions per branch, for multi-branch policies."""
    rows, values = [], []
    for policy, summary in summaries.items():
        counts = summary.branches
        total = sum(counts.values())
        if len(counts) > 1 and total:
            # A branch and its share stay on one line (a no-break space between them).
            parts = (f"{name}\u00a0{n / total:.0%}" for name, n in sorted(counts.items()))
            rows.append((policy, " · ".join(parts)))
            values.append({"policy": policy, **{k: counts[k] / total for k in sorted(counts)}})
    columns = (Column("policy", "left"), Column("branches", "left", wrap=True))
    return Table("branches", "Routing decisions per branch", columns, tuple(rows), tuple(values))


def disaggregation_table(summaries: Mapping[str, RunSummary]) -> Table:
    """What disaggregation adds per policy: the prefill stage, the KV pulls, the decode
    (simulated runs: a replay does not see the links)."""
    columns = (
        Column("policy", "left"),
        Column("prefill TPS\n@TTFT SLO"),
        Column("prefill TTFT s\np50/p90/p99"),
        Column("KV pulled\nGB"),
        Column("NIC use %\nP/D max"),
        Column("end-to-end\nTPS@SLO"),
    )
    rows, values = [], []
    for policy, s in summaries.items():
        pd = s.pd
        if pd is None or pd.nic_utilisation is None or pd.transfer_bytes is None:
            continue
        nics, e2e = pd.nic_utilisation, pd.end_to_end_tps_within_slo
        ttft = pd.prefill_ttft_s.to_builtins()
        rows.append(
            (
                policy,
                f"{pd.prefill_tps_within_slo:,.0f}",
                _three(pd.prefill_ttft_s, 1, 2),
                f"{pd.transfer_bytes / 1e9:,.1f}",
                f"{_num(nics.prefill.max, 100, 0)}/{_num(nics.decode.max, 100, 0)}",
                "-" if e2e is None else f"{e2e:,.0f}",
            )
        )
        values.append(
            {
                "policy": policy,
                "prefill_tps_within_slo": pd.prefill_tps_within_slo,
                **{f"prefill_ttft_{p}_s": ttft[p] for p in QUANTILES},
                "transfer_bytes": pd.transfer_bytes,
                "nic_prefill_max": nics.prefill.max,
                "nic_decode_max": nics.decode.max,
                "end_to_end_tps_within_slo": e2e,
            }
        )
    return Table("pd", "PD disaggregation", columns, tuple(rows), tuple(values))


def sweep_table(summary: SweepResult) -> Table:
    """Per policy and global tier: the best TPS within SLO over the offered rates."""
    seeds = " (mean ± sd over seeds)" if summary.seeds else ""
    tiers = summary.provisionings
    columns = (Column("policy", "left"), *(Column(f"global\n{g}") for g in tiers))
    rows, values, bold = [], [], set()
    for i, p in enumerate(summary.policies):
        cells = [p]
        value: dict[str, Any] = {"policy": p}
        for j, g in enumerate(tiers, start=1):
            row = summary.max_tps[g][p]
            top = max(v.tps for v in summary.max_tps[g].values())
            sd = "" if row.stdev is None else f" ± {row.stdev:,.0f}"
            cells.append(f"{row.tps:,.0f}{sd} (@{row.rate:g})")
            if row.tps == top and top > 0:
                bold.add((i, j))
            value |= {f"tps_{g}": row.tps, f"rate_{g}": row.rate}
            if row.stdev is not None:
                value[f"stdev_{g}"] = row.stdev
        rows.append(tuple(cells))
        values.append(value)
    title = f"Max TPS within SLO{seeds} (at offered rate, sessions/s)"
    return Table("max_tps", title, columns, tuple(rows), tuple(values), frozenset(bold))


def knee_table(summary: KneeSummary, default: str) -> Table:
    """Each policy's knee per cell, then the default policy's lead over the best baseline."""
    cells = summary.cells
    columns = (
        Column("policy", "left"),
        *(Column(f"global {c.global_}\n{c.kv_load} load") for c in cells),
    )
    marked = "\0"
    rows = knee_rows(summary, (default,), lambda v: f"{v:,.0f}", lambda t: marked + t)
    bold = {(i, j) for i, row in enumerate(rows) for j, c in enumerate(row) if c[:1] == marked}
    rows = [[c.removeprefix(marked) for c in row] for row in rows]
    values = []
    for row in rows:
        value: dict[str, Any] = {"policy": row[0]}
        for cell, text in zip(cells, row[1:], strict=True):
            key = f"{cell.global_}_{cell.kv_load}"
            knee = cell.knees.get(row[0])
            if knee is None:  # a "vs best baseline" row
                value[f"lead_{key}"] = text
            else:
                value |= {
                    f"mean_{key}": knee.mean,
                    f"stdev_{key}": knee.stdev,
                    f"load_{key}": knee.load,
                }
        values.append(value)
    title = "Max TPS within SLO: mean ± sd over seeds (at the knee's load)"
    return Table("knees", title, columns, tuple(map(tuple, rows)), tuple(values), frozenset(bold))


def plan_table(summary: PlanResult) -> Table:
    """Per policy, the fewest instances that serve the trace within SLO, and at what cost."""
    priced = summary.price_per_gpu_hour is not None
    unit = summary.load_unit
    title = (
        f"Fewest instances serving the trace's load ({summary.trace_load:g} {unit}) "
        f"with {summary.attainment:.0%} of requests within SLO"
    )
    headers = ["instances", "GPUs", "global tier", "TPS within SLO", "SLO met"]
    headers += ["$ / M tokens"] if priced else []
    columns = (Column("policy", "left"), *(Column(h) for h in headers))
    rows, values, bold = [], [], set()
    for i, (policy, plan) in enumerate(summary.plans.items()):
        if plan is None:
            most = summary.instances_searched[1]
            rows.append((policy, f"> {most}", *["-"] * (len(headers) - 1)))
            values.append({"policy": policy, "instances": None})
            continue
        size = plan.global_bytes
        tier = plan.global_ if not size else f"{plan.global_} ({size / 1e9:,.0f} GB)"
        if policy == summary.choice:
            bold.add((i, 0))
        row = [
            policy,
            str(plan.instances),
            str(plan.gpus),
            tier,
            f"{plan.tps_within_slo:,.0f}",
            f"{plan.slo_attainment:.0%}",
        ]
        value: dict[str, Any] = {
            "policy": policy,
            "instances": plan.instances,
            "gpus": plan.gpus,
            "global": plan.global_,
            "global_bytes": plan.global_bytes,
            "tps_within_slo": plan.tps_within_slo,
            "slo_attainment": plan.slo_attainment,
        }
        if priced:
            cost = plan.cost_per_million_tokens
            row.append("-" if cost is None else f"{cost:,.3f}")
            value["cost_per_million_tokens"] = cost
        rows.append(tuple(row))
        values.append(value)
    return Table("plans", title, columns, tuple(rows), tuple(values), frozenset(bold))
