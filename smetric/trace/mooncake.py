"""Loader for the Mooncake (Kimi) conversation trace: JSON lines of timestamped requests.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}``
with one id per 512-token prefix block, ids shared across the whole file. The trace records
no sessions, so they are *inferred* from the block ids (see ``smetric.trace.sessions``), and
the trace says so (``sessions_inferred``).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import polars as pl

from smetric.trace.jsonl import (
    BlockId,
    NonNegInt,
    block_columns,
    linked_time_columns,
    list_column,
    read_jsonl,
)
from smetric.trace.schema import Trace, finalize
from smetric.trace.sessions import chain_roots, infer_sessions

BLOCK_SIZE = 512


class _Request(msgspec.Struct):
    timestamp: float
    input_length: NonNegInt
    output_length: NonNegInt
    hash_ids: list[BlockId]


def load(path: Path) -> Trace:
    """Load a Mooncake JSONL trace, with sessions inferred from shared block prefixes."""
    records, _ = read_jsonl(path, _Request)
    stamps = np.fromiter((r.timestamp for r in records), dtype=np.float64, count=len(records))
    order = np.argsort(stamps, kind="stable")
    records = [records[i] for i in order]
    arrival = stamps[order] / 1000.0
    flat, offsets = block_columns([r.hash_ids for r in records])
    parents = infer_sessions(flat, offsets)
    roots, depths = chain_roots(parents)
    frame = pl.DataFrame(
        {
            "session_id": [f"s{r}" for r in roots.tolist()],
            "turn": depths,
            **linked_time_columns(parents, roots, arrival),
            "input_tokens": [r.input_length for r in records],
            "output_tokens": [r.output_length for r in records],
            "block_size": BLOCK_SIZE,
            "block_ids": list_column(flat, offsets),
        }
    )
    return Trace(
        requests=finalize(frame),
        name=path.name,
        source_format="mooncake",
        has_clock=True,
        sessions_inferred=True,
        notes=(
            "Sessions are inferred, not recorded: a request continues the latest earlier one "
            "whose block ids, all but the last, are the longest prefix of its own, provided "
            "that prefix spans at least two blocks and holds content first seen in that "
            "request's own session.",
            "think_time_s is the gap between the parent's and the request's arrival, an upper "
            "bound: the trace does not record when the parent's response ended.",
        ),
    )
