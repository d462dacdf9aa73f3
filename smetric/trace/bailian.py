"""Loader for the Alibaba Bailian (Qwen) usage traces: JSON lines with recorded sessions.

Each line is one request::

    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, ...]}

Unlike Mooncake, the conversation structure is recorded: ``parent_chat_id`` names the
request a turn follows (-1 or null for a first turn), so sessions are followed, not
inferred. ``hash_ids`` are ids of 16-token prefix blocks, shared across the file, and
``timestamp`` is seconds since the trace start.

The file is a time window cut out of production traffic, so a turn's parent may lie
before the window. Such an orphan starts a session of its own, and the trace's notes
count them instead of the load failing.
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
from smetric.trace.schema import Trace, TraceError, Trigger, finalize, is_compaction
from smetric.trace.sessions import ParentCycleError, chain_roots

BLOCK_SIZE = 16
NO_PARENT = -1


class _Request(msgspec.Struct):
    chat_id: int
    timestamp: float
    input_length: NonNegInt
    output_length: NonNegInt
    # The request kind (text, image, search, file): it does not tell who sent the turn.
    type: str
    turn: NonNegInt
    hash_ids: list[BlockId]
    parent_chat_id: int | None = None


def load(path: Path) -> Trace:
    """Load a Bailian JSONL trace, rows in arrival order, sessions from the parent links."""
    records, lines = read_jsonl(path, _Request)
    _check_unique(path, records, lines)
    parents, orphans = _parents(records)
    try:
        roots, depths = chain_roots(parents)
    except ParentCycleError as exc:
        raise TraceError(path, "parent_chat_id links form a loop", line=lines[exc.index]) from exc
    stamps = np.fromiter((r.timestamp for r in records), dtype=np.float64, count=len(records))
    order, parents, roots = _arrival_order(stamps, parents, roots, depths)
    records = [records[i] for i in order]
    arrival = stamps[order]
    flat, offsets = block_columns([r.hash_ids for r in records])
    frame = pl.DataFrame(
        {
            "session_id": [str(records[r].chat_id) for r in roots.tolist()],
            "turn": _turns(records),
            **linked_time_columns(parents, roots, arrival),
            "input_tokens": [r.input_length for r in records],
            "output_tokens": [r.output_length for r in records],
            "block_size": BLOCK_SIZE,
            "block_ids": list_column(flat, offsets),
            "trigger": _triggers(flat, offsets, parents),
        }
    )
    notes = [
        "think_time_s is the gap between the parent's and the request's arrival, an upper "
        "bound: the trace does not record when the parent's response ended.",
    ]
    if orphans:
        notes.append(
            f"{orphans} request(s) name a parent_chat_id absent from the file (it fell before "
            "the trace window); each starts a session of its own."
        )
    return Trace(
        requests=finalize(frame),
        name=path.name,
        source_format="bailian",
        has_clock=True,
        sessions_inferred=False,
        notes=tuple(notes),
    )


def _check_unique(path: Path, records: list[_Request], lines: list[int]) -> None:
    """A chat_id used twice would make parent links ambiguous; report the second use."""
    line_of: dict[int, int] = {}
    for record, line in zip(records, lines, strict=True):
        first = line_of.setdefault(record.chat_id, line)
        if first != line:
            raise TraceError(path, f"chat_id {record.chat_id} already used on line {first}", line)


def _parents(records: list[_Request]) -> tuple[np.ndarray, int]:
    """Row index of each request's parent (-1 for none) and how many parents are missing."""
    row_of = {record.chat_id: row for row, record in enumerate(records)}
    parents = np.full(len(records), -1, dtype=np.int64)
    orphans = 0
    for row, record in enumerate(records):
        if record.parent_chat_id is None or record.parent_chat_id == NO_PARENT:
            continue
        parent = row_of.get(record.parent_chat_id)
        if parent is None:
            orphans += 1
        else:
            parents[row] = parent
    return parents, orphans


def _arrival_order(
    stamps: np.ndarray, parents: np.ndarray, roots: np.ndarray, depths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row order by arrival, and parent and root indices renumbered to it.

    On equal timestamps a parent goes before its child (then file order), so that a
    request's parent always has a smaller request_id.
    """
    order = np.lexsort((depths, stamps))
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    ordered_parents = parents[order]
    renumbered = np.where(ordered_parents >= 0, rank[np.maximum(ordered_parents, 0)], -1)
    return order, renumbered, rank[roots[order]]


def _turns(records: list[_Request]) -> np.ndarray:
    """Turn numbers shifted so a first turn is 0, as the schema counts.

    Bailian counts turns from 1; a file that already counts from 0 is kept as it is.
    """
    turns = np.fromiter((r.turn for r in records), dtype=np.int64, count=len(records))
    return turns - min(1, int(turns.min()))


def _triggers(flat: np.ndarray, offsets: np.ndarray, parents: np.ndarray) -> list[str]:
    """Unknown, except a follow-up whose prefix shrank sharply: a context compaction.

    The ``type`` field tells what the request carries, not whether a user or an agent sent
    it, so nothing else can be said.
    """
    triggers = [Trigger.UNKNOWN.value] * len(parents)
    for row in np.flatnonzero(parents >= 0).tolist():
        parent = int(parents[row])
        parent_blocks = flat[offsets[parent] : offsets[parent + 1]]
        if is_compaction(parent_blocks, flat[offsets[row] : offsets[row + 1]]):
            triggers[row] = Trigger.COMPACTION.value
    return triggers
