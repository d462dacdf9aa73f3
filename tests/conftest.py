"""Shared test helpers: where the real public traces live, and small trace builders."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from smetric.trace.schema import Trace, finalize

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def real_trace(relative: str) -> Path:
    path = SHARED_TRACES / relative
    if not path.exists():
        pytest.skip(f"real trace {path} is not present on this machine")
    return path


def make_trace(rows: list[dict], *, has_clock: bool = False, name: str = "hand-made") -> Trace:
    """A trace from hand-written rows; columns left out take the schema's defaults."""
    return Trace(finalize(pl.DataFrame(rows)), name, "test", has_clock)
