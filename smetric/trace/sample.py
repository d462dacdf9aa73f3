"""Fewer sessions of a trace, chosen by a seed: the paper's way of scaling a replay down."""

from __future__ import annotations

import numpy as np
import polars as pl

from smetric.core.errors import UserError
from smetric.trace.schema import Trace


def sample_sessions(trace: Trace, fraction: float, seed: int) -> Trace:
    """Keep each session with probability ``fraction``: fewer sessions, same timing."""
    if not 0 < fraction <= 1:
        raise UserError(f"sample fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return trace
    sessions = trace.requests["session_id"].unique(maintain_order=True)
    keep = np.random.default_rng(seed).random(len(sessions)) < fraction
    kept = trace.requests.filter(pl.col("session_id").is_in(sessions.filter(keep).implode()))
    if kept.height == 0:
        raise UserError(f"sampling {fraction:g} of {len(sessions)} sessions kept none")
    return trace.with_requests(renumber(kept))


def renumber(frame: pl.DataFrame) -> pl.DataFrame:
    """Request ids 0..n-1 again after rows were dropped; parents outside become roots."""
    old = frame["request_id"]
    new = pl.int_range(frame.height, dtype=pl.Int64, eager=True)
    return frame.with_columns(
        request_id=new,
        parent_id=pl.col("parent_id").replace_strict(old, new, default=None),
    )
