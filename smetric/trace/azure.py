"""Loader for the Azure LLM inference traces (2023): a CSV of arrival times and lengths.

The header is ``TIMESTAMP,ContextTokens,GeneratedTokens`` with timestamps such as
``2023-11-16 18:15:46.6805900`` (seven fractional digits, more than Python's ``datetime``
keeps, so polars parses them at nanosecond precision). The trace records neither sessions
nor prompt content, so every request is a session of its own and has no block ids: it
gives arrival and length realism only, and prefix reuse cannot be measured on it.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from smetric.trace.schema import Trace, TraceError, finalize

BLOCK_SIZE = 16
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# The 2023 files carry naive timestamps; later releases append a UTC offset.
_NAIVE = "%Y-%m-%d %H:%M:%S%.f"
_WITH_OFFSET = "%Y-%m-%d %H:%M:%S%.f%#z"
# Line 1 is the header, so row i of the table is line i + 2 of the file.
_FIRST_ROW_LINE = 2


def load(path: Path) -> Trace:
    """Load an Azure CSV trace, one single-request session per row, in arrival order."""
    table = _parse(path, _read(path))
    # In expressions: a Python datetime would drop the seventh fractional digit.
    table = table.sort("arrival", maintain_order=True)
    arrival_s = table.select(
        (pl.col("arrival") - pl.col("arrival").first()).dt.total_nanoseconds() / 1e9
    ).to_series()
    frame = pl.DataFrame(
        {
            "session_id": [f"r{i}" for i in range(table.height)],
            "arrival_s": arrival_s,
            "session_time_s": 0.0,
            "input_tokens": table["input"],
            "output_tokens": table["output"],
            "block_size": BLOCK_SIZE,
        }
    )
    return Trace(
        requests=finalize(frame),
        name=path.name,
        source_format="azure",
        has_clock=True,
        notes=(
            "The trace has no sessions and no content hashes: every request is its own "
            "session and prefix reuse cannot be measured.",
        ),
    )


def _read(path: Path) -> pl.DataFrame:
    """The raw table, every cell a string, so that bad cells can be located afterwards."""
    try:
        raw = pl.read_csv(path, infer_schema=False)
    except pl.exceptions.NoDataError as exc:
        raise TraceError(path, "no requests") from exc
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise TraceError(path, f"cannot read CSV: {exc}") from exc
    missing = [c for c in COLUMNS if c not in raw.columns]
    if missing:
        raise TraceError(path, f"missing columns {missing}; expected {list(COLUMNS)}", line=1)
    if raw.height == 0:
        raise TraceError(path, "no requests")
    return raw


def _parse(path: Path, raw: pl.DataFrame) -> pl.DataFrame:
    """Typed columns ``arrival``, ``input``, ``output``; the first bad cell is an error."""
    stamp = pl.col("TIMESTAMP").str.strip_chars()
    table = raw.select(
        pl.coalesce(
            stamp.str.to_datetime(_NAIVE, time_unit="ns", strict=False),
            stamp.str.to_datetime(_WITH_OFFSET, time_unit="ns", strict=False)
            .dt.convert_time_zone("UTC")
            .dt.replace_time_zone(None),
        ).alias("arrival"),
        pl.col("ContextTokens").str.strip_chars().cast(pl.Int64, strict=False).alias("input"),
        pl.col("GeneratedTokens").str.strip_chars().cast(pl.Int64, strict=False).alias("output"),
    )
    problems = {
        "arrival": ("TIMESTAMP", "is not a timestamp like 2023-11-16 18:15:46.6805900"),
        "input": ("ContextTokens", "is not a token count (a non-negative integer)"),
        "output": ("GeneratedTokens", "is not a token count (a non-negative integer)"),
    }
    bad = table.select(
        pl.col("arrival").is_null(),
        pl.col("input").is_null() | (pl.col("input") < 0),
        pl.col("output").is_null() | (pl.col("output") < 0),
    )
    first_bad = {
        name: row
        for name in problems
        if bad[name].any() and (row := bad[name].arg_max()) is not None
    }
    if first_bad:
        name, row = min(first_bad.items(), key=lambda item: item[1])
        column, problem = problems[name]
        value = raw[column][row]
        raise TraceError(path, f"{column} {value!r} {problem}", line=row + _FIRST_ROW_LINE)
    return table
