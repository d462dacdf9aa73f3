"""PD disaggregation's metrics: the prefill stage scored on its own, beside the client's.

Shared by the simulator and by ``replay``, which measures the same columns on a live
disaggregated endpoint.
"""

from __future__ import annotations

import msgspec
import numpy as np
import polars as pl

from smetric.metrics.results import PDSummary, RunSummary
from smetric.metrics.slo import SLOConfig
from smetric.metrics.summary import (
    imbalance,
    measured_windows,
    percentiles,
    summarize,
    window_edges,
)
from smetric.trace.analysis.balance import window_loads


def with_prefill_latency(table: pl.DataFrame, slo: SLOConfig, horizon_s: float) -> pl.DataFrame:
    """The prefill stage's TTFT (arrival to its KV produced) and whether it met the SLO."""
    ttft = pl.col("prefill_done_s") - pl.col("arrival_s")
    limit = slo.ttft_base_s + slo.ttft_per_token_s * pl.col("prompt_tokens")
    done = pl.col("prefill_done_s").is_not_null() & (pl.col("prefill_done_s") <= horizon_s)
    return table.with_columns(prefill_ttft_s=ttft).with_columns(
        prefill_met_slo=(done & (pl.col("prefill_ttft_s") <= limit)).fill_null(False)
    )


def prefill_loads(table: pl.DataFrame, instances: int, window_s: float, horizon_s: float):
    """Mean in-flight prefill tokens per prefill instance and window (Figure 21b): each
    request's tokens to compute, from its arrival until its prefill ends."""
    routed = table.filter(pl.col("instance") >= 0)
    end = routed["prefill_done_s"].fill_null(horizon_s).clip(upper_bound=horizon_s).to_numpy()
    computed = routed["prompt_tokens"] - routed["local_hit_tokens"] - routed["global_hit_tokens"]
    return window_loads(
        routed["arrival_s"].to_numpy(),
        end,
        computed.to_numpy(),
        routed["instance"].to_numpy(),
        instances,
        window_edges(window_s, horizon_s),
    )


def disaggregated_summary(
    table: pl.DataFrame,
    slo: SLOConfig,
    horizon: float,
    prefill_instances: int,
    full: bool,
    window_s: float,
    warmup_s: float = 0.0,
) -> RunSummary:
    """The colocated summary with disaggregation's meaning, plus a ``pd`` section, from a
    per-request table with the prefill columns (simulated or measured by ``replay``).

    ``tps_within_slo`` counts prompt tokens (the paper's prefill TPS within SLO): of the
    requests that met the TTFT SLO (prefill-only) or both SLOs (full P/D, the client's
    TTFT, after the transfer and the decode's first step). Load and imbalance are the
    prefill instances' in-flight prefill tokens.
    """
    summary = summarize(table, slo, horizon, prefill_instances, window_s, warmup_s)
    measured = horizon - warmup_s
    after = table.filter(pl.col("arrival_s") >= warmup_s)
    done = after.filter(pl.col("completed"))
    met = done.filter(pl.col("met_slo"))
    prefilled = after.filter(pl.col("prefill_met_slo"))
    loads = prefill_loads(table, prefill_instances, window_s, horizon)
    prefill_ttft = after.filter(pl.col("prefill_done_s") <= horizon)["prefill_ttft_s"]
    decoded = table.filter(pl.col("decode_instance") >= 0)
    per_decoder = decoded["decode_instance"].value_counts().sort("decode_instance")
    return msgspec.structs.replace(
        summary,
        tps_within_slo=float(met["prompt_tokens"].sum()) / measured,
        tps=float(done["prompt_tokens"].sum()) / measured,
        tpot_s=summary.tpot_s if full else percentiles(np.array([])),
        imbalance=imbalance(loads, measured_windows(warmup_s, window_s)),
        load_heatmap=loads.tolist(),
        pd=PDSummary(
            mode="full" if full else "prefill-only",
            prefill_instances=prefill_instances,
            prefill_tps_within_slo=float(prefilled["prompt_tokens"].sum()) / measured,
            prefill_ttft_s=percentiles(prefill_ttft.to_numpy()),
            end_to_end_tps_within_slo=(
                float((met["prompt_tokens"] + met["output_tokens"]).sum()) / measured
                if full
                else None
            ),
            transfer_tokens=int(table["transfer_tokens"].fill_null(0).sum()),
            transfers=decoded.height,
            requests_per_decoder=per_decoder["count"].to_list() if full else [],
        ),
    )
