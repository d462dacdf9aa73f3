"""JSON-lines reading shared by the Mooncake and Bailian loaders.

Both formats are one request object per line and must report a bad line by its number;
both carry block ids that must fit the table's Int64 column.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Collection, Sequence
from itertools import chain
from pathlib import Path
from typing import Annotated, TypeVar

import msgspec
import numpy as np
import polars as pl

from smetric.trace.schema import TraceError

T = TypeVar("T")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
# Ids must fit the table's Int64 column.
BlockId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


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


def block_columns(blocks: Sequence[Collection[int]]) -> tuple[np.ndarray, np.ndarray]:
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


def linked_time_columns(parents: np.ndarray, roots: np.ndarray, arrival: np.ndarray) -> dict:
    """Parent, clock and think-time columns of a clocked trace whose rows are linked.

    The parent's completion is not recorded, so the arrival gap bounds think time from
    above.
    """
    chained = parents >= 0
    think = np.where(chained, arrival - arrival[np.maximum(parents, 0)], np.nan)
    return {
        "parent_id": pl.Series(parents).set(pl.Series(~chained), None),
        "arrival_s": arrival,
        "session_time_s": arrival - arrival[roots],
        "think_time_s": pl.Series(think, nan_to_null=True),
    }
