"""The paper's metrics from one run's per-request records (docs/concepts/metrics.md).

A run measures what completes within its horizon (the period in which sessions start or
requests arrive): TPS within SLO counts the prompt and output tokens of the requests that
completed by then and met both SLOs, divided by the horizon. Latency percentiles count
every completed request, met or not. Requests still running at the horizon count in
neither and are reported as such. A warm-up (``warmup_s``) leaves out the requests that
arrive before it from throughput, SLO attainment and latencies, and the time from the
rate: closed-loop sessions last tens of minutes, so a run's first part is still ramping.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from smetric.core.errors import ConfigError
from smetric.metrics.slo import SLOConfig
from smetric.trace.analysis.balance import window_loads

PERCENTILES = (50, 90, 99)
# Width of the windows in which load imbalance is measured, unless a run says otherwise.
WINDOW_S = 60.0


def with_latencies(table: pl.DataFrame, slo: SLOConfig, horizon_s: float) -> pl.DataFrame:
    ttft = pl.col("first_token_s") - pl.col("arrival_s")
    decode = pl.col("finished_s") - pl.col("first_token_s")
    tpot = pl.when(pl.col("output_tokens") > 1).then(decode / (pl.col("output_tokens") - 1))
    completed = pl.col("finished_s").is_not_null() & (pl.col("finished_s") <= horizon_s)
    return table.with_columns(
        ttft_s=ttft,
        tpot_s=tpot.otherwise(0.0),
        completed=completed & ~pl.col("rejected"),
    ).with_columns(
        met_slo=pl.col("completed")
        & (pl.col("ttft_s") <= slo.ttft_base_s + slo.ttft_per_token_s * pl.col("prompt_tokens"))
        & (pl.col("tpot_s") <= slo.tpot_s)
    )


def percentiles(values: np.ndarray) -> dict[str, float | None]:
    """The 50th, 90th and 99th percentiles of ``values``; None each when it is empty."""
    if len(values) == 0:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}


def stickiness(table: pl.DataFrame) -> dict[str, float | None]:
    """Share of follow-ups (turn > 0) served where a reference request was, three ways.

    - ``session``: the instance of the session's first request. A sub-agent starts a
      conversation of its own, so even a perfectly sticky policy scores below 1 here.
    - ``agent``: the instance of the first request of the follow-up's own conversation
      (the session's agent or sub-agent).
    - ``turn``: the instance of the previous turn of the same conversation (the parent).

    None where there are no follow-ups, or the table lacks the columns (a live replay
    records no agents or parents).
    """
    routed = table.filter(pl.col("instance") >= 0).sort("request_id")
    follow = routed.filter(pl.col("turn") > 0)

    def share(keys: list[str], home: pl.DataFrame, on: list[str]) -> float | None:
        joined = follow.select(*keys, "instance").join(home, on=on)
        if joined.height == 0:
            return None
        return float((joined["instance"] == joined["home"]).to_numpy().mean())

    def first_of(keys: list[str]) -> pl.DataFrame:
        return routed.group_by(keys).agg(pl.col("instance").first().alias("home"))

    out: dict[str, float | None] = {
        "session": share(["session_id"], first_of(["session_id"]), ["session_id"])
    }
    if "agent_id" in routed.columns and "parent_id" in routed.columns:
        agents = ["session_id", "agent_id"]
        out["agent"] = share(agents, first_of(agents), agents)
        parents = routed.select(pl.col("request_id").alias("parent_id"), home="instance")
        out["turn"] = share(["parent_id"], parents, ["parent_id"])
    else:
        out["agent"] = out["turn"] = None
    return out


def load_over_time(
    table: pl.DataFrame, instances: int, window_s: float, horizon_s: float
) -> np.ndarray:
    """Mean in-flight tokens (prompt + output) per instance and window, as Figure 15(b)."""
    routed = table.filter(pl.col("instance") >= 0)
    end = routed["finished_s"].fill_null(horizon_s).clip(upper_bound=horizon_s).to_numpy()
    edges = window_edges(window_s, horizon_s)
    tokens = (routed["prompt_tokens"] + routed["output_tokens"]).to_numpy()
    return window_loads(
        routed["arrival_s"].to_numpy(),
        end,
        tokens,
        routed["instance"].to_numpy(),
        instances,
        edges,
    )


def imbalance(loads: np.ndarray, first_window: int = 0) -> dict:
    """Max over mean load per window (instances x windows), over the windows with load
    from ``first_window`` on (the ones after the warm-up, which throughput counts too)."""
    loads = loads[:, first_window:]
    mean = loads.mean(axis=0)
    busy = mean > 0
    ratio = loads.max(axis=0)[busy] / mean[busy]
    return {
        "mean": float(ratio.mean()) if len(ratio) else math.nan,
        "p50": float(np.percentile(ratio, 50)) if len(ratio) else math.nan,
        "p90": float(np.percentile(ratio, 90)) if len(ratio) else math.nan,
        "max": float(ratio.max()) if len(ratio) else math.nan,
        "series": ratio.tolist(),
    }


def measured_windows(warmup_s: float, window_s: float) -> int:
    """The first load window that starts at or after the warm-up: the windows every
    figure and table of a run counts."""
    return math.ceil(warmup_s / window_s - 1e-9)


def window_edges(window_s: float, horizon_s: float) -> np.ndarray:
    """Edges of the load windows over the run: ``window_s`` wide, at least one window."""
    edges = np.arange(0.0, horizon_s + window_s, window_s)
    edges = edges[edges <= horizon_s + 1e-9]
    return edges if len(edges) >= 2 else np.array([0.0, horizon_s])


def tps_under_slo(table: pl.DataFrame, summary: dict, slo: SLOConfig, instances: int) -> float:
    """TPS within ``slo`` of a finished colocated run (its per-request table and summary):
    the SLO only scores requests, so a run can be scored again under another without
    running it again."""
    horizon = summary["horizon_s"]
    scored = with_latencies(table, slo, horizon)
    return summarize(scored, slo, horizon, instances, summary["window_s"], summary["warmup_s"])[
        "tps_within_slo"
    ]


def summarize(
    table: pl.DataFrame,
    slo: SLOConfig,
    horizon_s: float,
    instances: int,
    window_s: float,
    warmup_s: float = 0.0,
) -> dict:
    if not 0 <= warmup_s < horizon_s:
        raise ConfigError(f"warm-up {warmup_s:g} s must lie in [0, horizon {horizon_s:g} s)")
    measured = horizon_s - warmup_s
    done = table.filter(pl.col("completed") & (pl.col("arrival_s") >= warmup_s))
    met = done.filter(pl.col("met_slo"))
    tokens = pl.col("prompt_tokens") + pl.col("output_tokens")
    admitted = table.filter(pl.col("instance") >= 0)
    prompt = int(admitted["prompt_tokens"].sum())
    local = int(admitted["local_hit_tokens"].sum())
    remote = int(admitted["global_hit_tokens"].sum())
    loads = load_over_time(table, instances, window_s, horizon_s)
    branches = admitted["branch"].value_counts().sort("branch").rows()
    return {
        "horizon_s": horizon_s,
        "warmup_s": warmup_s,
        "window_s": window_s,
        "requests": {
            "issued": table.height,
            "completed": done.height,
            "met_slo": met.height,
            "rejected": int(table["rejected"].sum()),
            "unfinished": int(admitted.filter(~pl.col("completed")).height),
            "preemptions": int(table["preemptions"].sum()),
        },
        "tps_within_slo": float(met.select(tokens.sum()).item() or 0) / measured,
        "tps": float(done.select(tokens.sum()).item() or 0) / measured,
        "slo_attainment": met.height / done.height if done.height else 0.0,
        "ttft_s": percentiles(done["ttft_s"].to_numpy()),
        "tpot_s": percentiles(done.filter(pl.col("output_tokens") > 1)["tpot_s"].to_numpy()),
        "reuse": {
            "prompt_tokens": prompt,
            "local": local / prompt if prompt else 0.0,
            "global": remote / prompt if prompt else 0.0,
            "miss": 1 - (local + remote) / prompt if prompt else 0.0,
        },
        "imbalance": imbalance(loads, measured_windows(warmup_s, window_s)),
        "load_heatmap": loads.tolist(),
        "stickiness": stickiness(table),
        "branches": {name: int(count) for name, count in branches},
    }
