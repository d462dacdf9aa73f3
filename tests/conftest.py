"""Shared test helpers: where the real public traces live, and small trace builders."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

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


def block_stored(
    hashes: list[Any], parent: Any, tokens: list[int], block_size: int, medium: Any = "GPU"
) -> dict[str, Any]:
    """A BlockStored event as recent vLLM encodes it (map form), fields the router ignores
    included."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": 0,
    }


async def until_heard(
    send: Callable[[int], Awaitable[Any]], heard: Callable[[], bool], tries: int = 40
) -> None:
    """Send small requests (``send(attempt)``) until ``heard()``: a ZMQ subscriber misses
    what is published before its subscription reaches the publisher (the slow joiner,
    slower on a busy machine), so a test waits for proof that the stream flows rather
    than sleeping and hoping."""
    loop = asyncio.get_running_loop()
    for attempt in range(tries):
        await send(attempt)
        deadline = loop.time() + 0.5
        while loop.time() < deadline:
            if heard():
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"no KV-event batch was heard after {tries} requests")
