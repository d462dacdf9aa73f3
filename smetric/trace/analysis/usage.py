"""Who asks for what: request triggers (Figure 7) and per-session token usage (Figure 8)."""

from __future__ import annotations

import numpy as np
import polars as pl

from smetric.trace.analysis.results import Curve, SessionUsage, TopShares, Triggers
from smetric.trace.schema import Trigger

LORENZ_POINTS = 101
PER_SESSION_CAP = 2000


def _tokens() -> pl.Expr:
    return pl.col("input_tokens") + pl.col("output_tokens")


def trigger_breakdown(requests: pl.DataFrame) -> Triggers:
    counts = requests.group_by("trigger").agg(pl.len().alias("n"), _tokens().sum().alias("t"))
    by_trigger = {row["trigger"]: row for row in counts.iter_rows(named=True)}
    names = [t.value for t in Trigger]
    return Triggers(
        requests={k: int(by_trigger[k]["n"]) if k in by_trigger else 0 for k in names},
        tokens={k: int(by_trigger[k]["t"]) if k in by_trigger else 0 for k in names},
    )


def gini(values: np.ndarray) -> float:
    """0 when every session uses the same, towards 1 when one session uses everything."""
    v = np.sort(values.astype(np.float64))
    n = len(v)
    if n == 0 or v.sum() == 0:
        return 0.0
    ranks = np.arange(1, n + 1)
    return float((2 * (ranks * v).sum()) / (n * v.sum()) - (n + 1) / n)


def session_usage(requests: pl.DataFrame) -> SessionUsage:
    per_session = requests.group_by("session_id").agg(_tokens().sum().alias("t"))["t"].to_numpy()
    desc = np.sort(per_session)[::-1]
    total = float(desc.sum()) or 1.0
    n = len(desc)

    def top_share(fraction: float) -> float:
        return float(desc[: max(1, int(np.ceil(fraction * n)))].sum() / total)

    asc_cum = np.concatenate([[0.0], np.cumsum(desc[::-1]) / total])
    x = np.linspace(0, 1, LORENZ_POINTS)
    y = np.interp(x, np.linspace(0, 1, n + 1), asc_cum)
    return SessionUsage(
        sessions=n,
        mean=float(desc.mean()),
        p50=float(np.percentile(desc, 50)),
        p90=float(np.percentile(desc, 90)),
        p99=float(np.percentile(desc, 99)),
        max=float(desc[0]),
        top_share=TopShares(top_1=top_share(0.01), top_10=top_share(0.10), top_20=top_share(0.20)),
        gini=gini(desc),
        lorenz=Curve(x=x.tolist(), y=y.tolist()),
        per_session_tokens=[int(v) for v in desc[:PER_SESSION_CAP]],
    )
