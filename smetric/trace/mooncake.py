"""Loader for the Mooncake (Kimi) conversation trace: JSON lines of timestamped requests.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}``
with one id per 512-token prefix block, ids shared across the whole file. The trace records
no sessions, so they are *inferred* from the block ids (see ``smetric.trace.sessions``), and
the trace says so (``sessions_inferred``).

The JSON-lines reader here is shared with the Bailian loader: both formats are one request
object per line and must report a bad line by its number.
"""

from __future__ import annotations

import gzip
import zlib
from itertools import chain
from pathlib import Path
from typing import Annotated, TypeVar

import msgspec
import numpy as np
import polars as pl

from smetric.trace.schema import Trace, TraceError, finalize
from smetric.trace.sessions import chain_roots, infer_sessions

BLOCK_SIZE = 512

T = TypeVar("T")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
# Ids must fit the table's Int64 column.
BlockId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class _Request(msgspec.Struct):
    timestamp: float
    input_length: NonNegInt
    output_length: NonNegInt
    hash_ids: list[BlockId]


def read_jsonl(path: Path, kind: type[T]) -> tuple[list[T], list[int]]:
    """Every non-blank line decoded as ``kind``, with its 1-based line number (``.gz`` too).

    Any line that is not valid JSON or does not fit ``kind`` fails the whole load, located,
    rather than being skipped: a silently shortened trace would skew every statistic.
    """
    try:
        data = path.read_bytes()
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(path, f"cannot read file: {exc}") from exc
    decoder = msgspec.json.Decoder(kind)
    records: list[T] = []
    lines: list[int] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            records.append(decoder.decode(raw))
        except msgspec.DecodeError as exc:
            raise TraceError(path, str(exc), line=number) from exc
        lines.append(number)
    if not records:
        raise TraceError(path, "no requests")
    return records, lines


def block_columns(blocks: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids and per-request offsets, the form loops over block ids work on."""
    offsets = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blocks], out=offsets[1:])
    flat = np.fromiter(chain.from_iterable(blocks), dtype=np.int64, count=int(offsets[-1]))
    return flat, offsets


def list_column(flat: np.ndarray, offsets: np.ndarray) -> pl.Series:
    """The ``block_ids`` column, built from the flat form without a Python list per row."""
    spans = pl.DataFrame({"start": offsets[:-1], "length": np.diff(offsets)})
    every_id = pl.lit(pl.Series(flat, dtype=pl.Int64).implode())
    return spans.select(
        every_id.list.slice(pl.col("start"), pl.col("length")).alias("block_ids")
    ).to_series()


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
    chained = parents >= 0
    # The parent's completion time is unknown, so the arrival gap bounds think time from above.
    think = np.where(chained, arrival - arrival[np.maximum(parents, 0)], np.nan)
    frame = pl.DataFrame(
        {
            "session_id": [f"s{r}" for r in roots.tolist()],
            "turn": depths,
            "parent_id": pl.Series(parents).set(pl.Series(~chained), None),
            "arrival_s": arrival,
            "session_time_s": arrival - arrival[roots],
            "think_time_s": pl.Series(think, nan_to_null=True),
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
