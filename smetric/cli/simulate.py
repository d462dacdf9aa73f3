"""``smetric simulate`` and ``smetric sweep``: the paper's evaluation on a simulated cluster."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from smetric.cli.app import (
    TableFormatOpt,
    app,
    console,
    load_with_progress,
    out_console,
    progress_bar,
    slug,
    user_errors,
)
from smetric.core.policies import POLICY_NAMES, base_name, hardware_params, make_policy
from smetric.core.policies.decode import DECODE_POLICY_NAMES
from smetric.metrics.runs import run_file_name
from smetric.model.perf import load_medium
from smetric.report.run_tables import (
    branches_table,
    disaggregation_table,
    results_table,
    sweep_table,
)
from smetric.report.tables import check_format, emit
from smetric.sim.config import (
    SimConfig,
    check_config,
    check_disaggregation,
    check_kv_load,
    dump_yaml,
    load_yaml,
    parse_global_capacity,
)
from smetric.sim.jobs import Job
from smetric.sim.parallel import RunStore, default_jobs, run_jobs, run_sweep
from smetric.sim.result import RunResult
from smetric.sim.seeds import mean_summary, spread

CLUSTER = "Cluster"
WORKLOAD = "Workload"
SLO = "SLO"


def _opt(help_text: str, panel: str, *names: str, **kwargs: Any) -> Any:
    return typer.Option(*names, help=help_text, rich_help_panel=panel, **kwargs)


SourceArg = Annotated[
    str | None,
    typer.Argument(
        help="Trace (as for analyze) [default: the config's, else sample:weka].",
        show_default=False,
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="YAML file with cluster/workload/slo/policies; flags override it."
    ),
]
PoliciesOpt = Annotated[
    str | None,
    typer.Option(
        "--policies",
        "-p",
        help=f"Comma-separated policies (name or name:key=value,...) or 'all': "
        f"{', '.join(POLICY_NAMES)}.",
    ),
]
InstancesOpt = Annotated[int | None, _opt("Instances in the cluster.", CLUSTER, min=1)]
ModelOpt = Annotated[str | None, _opt("Model preset.", CLUSTER)]
HardwareOpt = Annotated[str | None, _opt("GPU preset (H20, H100, H200).", CLUSTER)]
GpusOpt = Annotated[int | None, _opt("GPUs per instance (tensor parallel).", CLUSTER, min=1)]
WeightDtypeOpt = Annotated[str | None, _opt("Weight dtype (bf16, fp8, fp32).", CLUSTER)]
KvDtypeOpt = Annotated[str | None, _opt("KV-cache dtype (bf16, fp8, fp32).", CLUSTER)]
MemUtilOpt = Annotated[
    float | None, _opt("GPU memory utilisation.", CLUSTER, "--mem-util", min=0.1, max=1.0)
]
KvTokensOpt = Annotated[
    int | None,
    _opt("KV room per instance in tokens [default: from GPU memory].", CLUSTER, min=1),
]
MaxLenOpt = Annotated[
    int | None, _opt("Maximum context; longer requests are rejected.", CLUSTER, min=1)
]
MaxSeqsOpt = Annotated[int | None, _opt("Running sequences cap per instance.", CLUSTER, min=1)]
BatchTokensOpt = Annotated[
    int | None, _opt("Token budget per engine step (chunked prefill).", CLUSTER, min=1)
]
GlobalOpt = Annotated[
    str | None,
    _opt(
        "Global KV tier: none, full, or a multiple of local capacity (1.6x).", CLUSTER, "--global"
    ),
]
BandwidthOpt = Annotated[
    float | None,
    _opt("Effective bandwidth of one RDMA NIC, GB/s (21.7: one 200 Gbps NIC).", CLUSTER, min=0.001),
]
NicsOpt = Annotated[
    int | None,
    _opt(
        "RDMA NICs per server, shared by its 8 GPUs' global-tier traffic (4).",
        CLUSTER,
        min=1,
    ),
]
MediumOpt = Annotated[
    str | None,
    _opt(
        "How the global tier moves KV end to end: line-rate (the paper's testbed), "
        "lmcache-cpu (41 GB/s), mooncake-rdma (6.4 GB/s) or mooncake-tcp (3.2 GB/s); "
        "`smetric model` shows each one's cost [default: line-rate].",
        CLUSTER,
    ),
]
KvLoadOpt = Annotated[
    str | None,
    _opt(
        "Global-tier loads: sync (before the forward pass, stretching the step; LMCache's "
        "default) or async (the request waits, the batch runs on).",
        CLUSTER,
    ),
]
PrefillOpt = Annotated[
    int | None,
    _opt(
        "PD disaggregation: prefill-only instances, routed by the policy on unprefilled "
        "tokens; replaces --instances [default: 0, colocated].",
        CLUSTER,
        min=0,
    ),
]
DecodeOpt = Annotated[
    int | None,
    _opt(
        "PD disaggregation: decode instances the prefills hand their KV to over the NICs; "
        "0 is the paper's prefill-only evaluation (decode not modelled).",
        CLUSTER,
        min=0,
    ),
]
DecodePolicyOpt = Annotated[
    str | None,
    _opt(f"How the decode instance is chosen: {', '.join(DECODE_POLICY_NAMES)}.", CLUSTER),
]
RateOpt = Annotated[float | None, _opt("Session starts per second.", WORKLOAD, min=1e-6)]
DurationOpt = Annotated[
    float | None, _opt("Seconds of arrivals; what completes by then counts.", WORKLOAD, min=1.0)
]
OpenLoopOpt = Annotated[
    bool | None,
    _opt(
        "Replay recorded arrival times (traces with a clock).",
        WORKLOAD,
        "--open-loop/--closed-loop",
    ),
]
SampleOpt = Annotated[
    float | None,
    _opt(
        "Open loop: fraction of sessions kept (the paper's load scaling).",
        WORKLOAD,
        min=1e-6,
        max=1.0,
    ),
]
SpeedOpt = Annotated[float | None, _opt("Open-loop replay speed-up.", WORKLOAD, min=1e-6)]
WarmupOpt = Annotated[
    float | None,
    _opt(
        "Seconds at the start left out of throughput and latency (sessions still ramping).",
        WORKLOAD,
        min=0.0,
    ),
]
SeedOpt = Annotated[int | None, _opt("Seed for session starts and picks.", WORKLOAD)]
TtftBaseOpt = Annotated[float | None, _opt("TTFT SLO constant, seconds.", SLO, min=0.0)]
TtftPerTokenOpt = Annotated[float | None, _opt("TTFT SLO seconds per input token.", SLO, min=0.0)]
TpotOpt = Annotated[float | None, _opt("TPOT SLO, seconds.", SLO, min=0.0)]
OutOpt = Annotated[Path | None, typer.Option("--out", "-o", help="Result folder.")]
JobsOpt = Annotated[
    int | None, typer.Option("--jobs", "-j", help="Worker processes [default: CPUs].", min=1)
]


# Each command's override flag (its parameter name) -> the field it sets.
CLUSTER_FLAGS = {
    "instances": "instances",
    "model": "model",
    "hardware": "hardware",
    "gpus": "gpus_per_instance",
    "weight_dtype": "weight_dtype",
    "kv_dtype": "kv_dtype",
    "mem_util": "gpu_memory_utilization",
    "kv_tokens": "kv_capacity_tokens",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_batched_tokens": "max_num_batched_tokens",
    "global_capacity": "global_capacity",
    "nic_bandwidth": "nic_gb_s",
    "nics_per_server": "nics_per_server",
    "global_medium": "global_medium",
    "kv_load": "kv_load",
    "prefill_instances": "prefill_instances",
    "decode_instances": "decode_instances",
    "decode_policy": "decode_policy",
}
WORKLOAD_FLAGS = {
    "rate": "session_rate",
    "duration": "duration_s",
    "open_loop": "open_loop",
    "sample": "sample",
    "speed": "speed",
    "seed": "seed",
}
SLO_FLAGS = {"ttft_base": "ttft_base_s", "ttft_per_token": "ttft_per_token_s", "tpot": "tpot_s"}
CONFIG_FLAGS = {*CLUSTER_FLAGS, *WORKLOAD_FLAGS, *SLO_FLAGS, "warmup", "policies"}


def command_config(params: dict[str, Any]) -> SimConfig:
    """The configuration a command's parameters (its ``locals()`` on entry) describe: its
    config file and trace with whichever override flags it offers, so that a flag added
    to a command reaches the configuration without being named twice."""
    flags = {k: v for k, v in params.items() if k in CONFIG_FLAGS}
    config_path, trace = params.get("config_path"), params.get("source")
    config = load_yaml(config_path) if config_path else SimConfig()
    config = config.override("cluster", **{v: flags.get(k) for k, v in CLUSTER_FLAGS.items()})
    config = config.override("workload", **{v: flags.get(k) for k, v in WORKLOAD_FLAGS.items()})
    config = config.override("slo", **{v: flags.get(k) for k, v in SLO_FLAGS.items()})
    if trace is not None:
        config = config.override("workload", trace=trace)
    if flags.get("warmup") is not None:
        config = dataclasses.replace(config, warmup_s=flags["warmup"])
    check_config(config)
    if config.warmup_s >= config.workload.duration_s:
        raise ValueError(
            f"--warmup {config.warmup_s:g} must be shorter than --duration "
            f"{config.workload.duration_s:g}"
        )
    policies = flags.get("policies")
    if policies:
        names = POLICY_NAMES if policies == "all" else split_policies(policies)
        config = dataclasses.replace(config, policies=tuple(names))
    for spec in config.policies:
        make_policy(spec)  # fails early, with the valid names, on a typo
    parse_global_capacity(config.cluster.global_capacity)
    check_kv_load(config.cluster.kv_load)
    load_medium(config.cluster.global_medium)  # fails early, with the valid names
    check_disaggregation(config.cluster)
    return config


def split_policies(text: str) -> tuple[str, ...]:
    """'smetric,linear:lam=0.95' -> two specs; a ',' inside name:k=v,k=v stays with it."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    return tuple(out)


def hardware_lines(results: dict[str, RunResult]) -> list[str]:
    """What each policy assumed of the hardware, where the simulator derived it, and
    what it learned from its requests, where it learns."""
    lines = []
    for policy, result in results.items():
        derived = hardware_params(base_name(policy))
        if derived:
            values = ", ".join(f"{k}={result.policy_params[k]:g}" for k in derived)
            lines.append(f"{policy} assumed {values}")
        learned = result.summary.get("learned_params")
        if learned:
            values = ", ".join(f"{k}={v:.3g}" for k, v in learned.items())
            count = result.summary["learned_from"]
            lines.append(f"{policy} learned {values} from {count:,} requests")
    return lines


def write_results(out: Path, config: SimConfig, results: dict[str, RunResult]) -> int:
    """Configuration, summaries, per-request tables and plots; returns the plot count."""
    from smetric.report.simulation import write_simulation_pngs

    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(config, out / "config.yaml")
    shape = next(iter(results.values())).shape
    summary = {
        "cluster_shape": vars(shape),
        "policies": {policy: r.summary for policy, r in results.items()},
        "policy_params": {policy: r.policy_params for policy, r in results.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for policy, result in results.items():
        result.requests.write_parquet(out / run_file_name(policy))
    summaries = {policy: r.summary for policy, r in results.items()}
    tables = {policy: r.requests for policy, r in results.items()}
    return len(write_simulation_pngs(summaries, tables, out))


@app.command()
def simulate(
    source: SourceArg = None,
    config_path: ConfigOpt = None,
    policies: PoliciesOpt = None,
    instances: InstancesOpt = None,
    model: ModelOpt = None,
    hardware: HardwareOpt = None,
    gpus: GpusOpt = None,
    weight_dtype: WeightDtypeOpt = None,
    kv_dtype: KvDtypeOpt = None,
    mem_util: MemUtilOpt = None,
    kv_tokens: KvTokensOpt = None,
    max_model_len: MaxLenOpt = None,
    max_num_seqs: MaxSeqsOpt = None,
    max_batched_tokens: BatchTokensOpt = None,
    global_capacity: GlobalOpt = None,
    nic_bandwidth: BandwidthOpt = None,
    nics_per_server: NicsOpt = None,
    global_medium: MediumOpt = None,
    kv_load: KvLoadOpt = None,
    prefill_instances: PrefillOpt = None,
    decode_instances: DecodeOpt = None,
    decode_policy: DecodePolicyOpt = None,
    rate: RateOpt = None,
    duration: DurationOpt = None,
    open_loop: OpenLoopOpt = None,
    sample: SampleOpt = None,
    speed: SpeedOpt = None,
    seed: SeedOpt = None,
    warmup: WarmupOpt = None,
    ttft_base: TtftBaseOpt = None,
    ttft_per_token: TtftPerTokenOpt = None,
    tpot: TpotOpt = None,
    out: OutOpt = None,
    jobs: JobsOpt = None,
    table_format: TableFormatOpt = "table",
) -> None:
    """Simulate one cluster configuration under the chosen policies, side by side.

    Writes the resolved configuration, a summary JSON, one per-request Parquet table per
    policy and plots to the result folder [default: smetric-out/simulate-TRACE].
    """
    params = locals()
    with user_errors():
        check_format(table_format)
        config = command_config(params)
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
    plots = write_results(out, config, ordered)
    shape = next(iter(ordered.values())).shape
    summaries = {policy: result.summary for policy, result in ordered.items()}
    tables = [results_table(_title(config, shape), summaries), branches_table(summaries)]
    if config.cluster.prefill_instances:
        tables.append(disaggregation_table(summaries))
    emit(tables, table_format, console)
    notes = out_console(table_format)
    first = next(iter(ordered.values())).summary["requests"]
    notes.print(
        f"TPS@SLO: {_tps_meaning(config)} · "
        f"{first['rejected']} requests longer than max_model_len "
        f"({shape.max_model_len:,}) rejected"
    )
    for line in hardware_lines(ordered):
        notes.print(line)
    notes.print(f"\nwrote {out}/ (config.yaml, summary.json, requests-*.parquet, {plots} plots)")


def _tps_meaning(config: SimConfig) -> str:
    cluster = config.cluster
    if not cluster.prefill_instances:
        return "prompt + output tokens/s of requests that met both SLOs"
    if not cluster.decode_instances:
        return "prompt tokens/s of requests that met the TTFT SLO (prefill only)"
    return "prompt tokens/s of requests that met both SLOs (TTFT after the KV pull)"


def _title(config: SimConfig, shape: Any) -> str:
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


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{what}: expected positive numbers, got {text!r}")
    return values


def global_levels(text: str) -> list[str]:
    """'none,1x,full' -> the checked global-tier capacities."""
    levels = [g.strip() for g in text.split(",") if g.strip()]
    for level in levels:
        parse_global_capacity(level)
    return levels


def sweep_summary(
    rates: list[float], provisionings: list[str], policies: tuple[str, ...], results: dict
) -> dict:
    """Every cell's summary, and each policy's best TPS within SLO per provisioning.

    ``results`` holds each (rate, provisioning, policy) cell's summaries, one per seed.
    With several seeds a cell's summary is their mean (``mean_summary``) with the seeds'
    TPS within SLO and its standard deviation beside it, and the best rate is the one with
    the best mean; with one seed the cell is that run's summary as it is.
    """
    runs = []
    for g in provisionings:
        for p in policies:
            for r in rates:
                seeds = results[(r, g, p)]
                run: dict = {"rate": r, "global": g, "policy": p, "summary": seeds[0]}
                if len(seeds) > 1:
                    tps = [s["tps_within_slo"] for s in seeds]
                    run["summary"] = mean_summary(seeds)
                    run["seeds_tps"] = tps
                    run["stdev"] = spread(tps)
                runs.append(run)
    best: dict[str, dict[str, dict[str, float]]] = {}
    for run in runs:
        slot = best.setdefault(run["global"], {})
        current = slot.get(run["policy"])
        tps = run["summary"]["tps_within_slo"]
        if current is None or tps > current["tps"]:
            slot[run["policy"]] = {"tps": tps, "rate": run["rate"]}
            if "stdev" in run:
                slot[run["policy"]]["stdev"] = run["stdev"]
    summary = {
        "rates": rates,
        "provisionings": provisionings,
        "policies": list(policies),
        "runs": runs,
        "max_tps": best,
    }
    seeds = max(len(v) for v in results.values())
    return summary | {"seeds": seeds} if seeds > 1 else summary


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
def sweep(
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
    instances: InstancesOpt = None,
    prefill_instances: PrefillOpt = None,
    decode_instances: DecodeOpt = None,
    model: ModelOpt = None,
    hardware: HardwareOpt = None,
    duration: DurationOpt = None,
    warmup: WarmupOpt = None,
    seed: SeedOpt = None,
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
    params = locals()
    from smetric.report.simulation import write_sweep_pngs

    with user_errors():
        check_format(table_format)
        rate_values = _floats(rates, "--rates")
        levels = global_levels(provisionings)
        base = command_config(params)
        first = base.workload.seed
        runs = [
            Job(
                (r, g, p, s),
                base.override("workload", session_rate=r, seed=s).override(
                    "cluster", global_capacity=g
                ),
                p,
            )
            for g in levels
            for p in base.policies
            for r in rate_values
            for s in range(first, first + seeds)
        ]
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
    cells: dict[tuple, list[dict]] = {}
    for job in runs:  # in seed order, whatever order the runs finished in
        cells.setdefault(job.key[:3], []).append(results[job.key])
    summary = sweep_summary(rate_values, levels, base.policies, cells)
    out.mkdir(parents=True, exist_ok=True)
    dump_yaml(base, out / "config.yaml")
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    pngs = write_sweep_pngs(summary, out)
    emit([sweep_table(summary)], table_format, console)
    reused = f", {len(runs) - ran} of {len(runs)} runs reused from runs/" if ran < len(runs) else ""
    notes = out_console(table_format)
    notes.print(f"\nwrote {out}/ (config.yaml, sweep.json, {len(pngs)} plots{reused})")
