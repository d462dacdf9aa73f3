"""The simulator's per-request records, kept as columns while a run goes on."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import polars as pl

from smetric.sim.instance import SimRequest

_NO_BLOCKS = np.empty(0, dtype=np.int64)


def request_table(requests: list[SimRequest], horizon_s: float) -> pl.DataFrame:
    """Per-request results, for every request issued before the horizon."""
    issued = [r for r in requests if r.arrival <= horizon_s and (r.instance >= 0 or r.rejected)]
    return pl.DataFrame(
        {
            "request_id": [r.rid for r in issued],
            "session_id": [r.session for r in issued],
            "agent_id": [r.agent for r in issued],
            "turn": [r.turn for r in issued],
            "parent_id": [r.parent for r in issued],
            "instance": [r.instance for r in issued],
            "branch": [r.branch for r in issued],
            "rejected": [r.rejected for r in issued],
            "arrival_s": [r.arrival for r in issued],
            "first_token_s": [r.first_token_at for r in issued],
            "finished_s": [r.finished_at for r in issued],
            "prompt_tokens": [r.prompt for r in issued],
            "output_tokens": [r.output for r in issued],
            "est_hit_tokens": [r.est_hit for r in issued],
            "local_hit_tokens": [r.local_hit for r in issued],
            "global_hit_tokens": [r.global_hit for r in issued],
            "preemptions": [r.preemptions for r in issued],
        },
        schema_overrides={"first_token_s": pl.Float64, "finished_s": pl.Float64},
    ).with_columns(
        pl.col("first_token_s").fill_nan(None),
        pl.col("finished_s").fill_nan(None),
    )


class RequestLog:
    """Per-request rows, recorded as requests finish, in columnar chunks.

    A finished request's row goes into a chunk of ``request_table`` rows and the request
    itself is let go, so a run of millions of requests holds a table's worth of numbers
    per request rather than its objects and block ids.
    """

    CHUNK = 16_384

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._pending: list[SimRequest] = []
        self._chunks: list[pl.DataFrame] = []

    def add(self, req: SimRequest) -> None:
        # Its block ids are most of what it holds and nothing reads them any more.
        req.blocks = _NO_BLOCKS
        self._pending.append(req)
        if len(self._pending) >= self.CHUNK:
            self._flush()

    def table(self, unfinished: Iterable[SimRequest] = ()) -> pl.DataFrame:
        """Every recorded row plus ``unfinished`` requests', in request order; the log lets
        its chunks go, so only the sorted table remains."""
        self._pending.extend(unfinished)
        self._flush()
        chunks, self._chunks = self._chunks, []
        if not chunks:
            return request_table([], self.horizon_s)
        return pl.concat(chunks, how="vertical_relaxed").sort("request_id")

    def _flush(self) -> None:
        if self._pending:
            self._chunks.append(request_table(self._pending, self.horizon_s))
            self._pending = []
