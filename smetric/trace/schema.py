"""The normalised request table every trace format is loaded into.

Whatever the source (Claude Code sessions, Mooncake, Bailian, Azure), the rest of SMetric
sees one columnar table with the columns below, one row per LLM request, in the trace's
issue order. Columns a format cannot fill are null (or empty lists for ``block_ids``) rather
than guessed, and ``Trace`` records which of its facts were inferred.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
import polars as pl

# Where every loader has always found it.
from smetric.core.errors import TraceError as TraceError


class Trigger(StrEnum):
    """What made a request happen (the paper's Figure 7)."""

    USER = "user"
    AGENT = "agent"
    COMPACTION = "compaction"
    UNKNOWN = "unknown"


TRIGGER_DTYPE = pl.Enum([t.value for t in Trigger])

SCHEMA: dict[str, pl.DataType] = {
    # Dense row id, 0..n-1 in issue order; parent_id refers to it.
    "request_id": pl.Int64(),
    # Conversation grouping: a session holds one root agent and its sub-agents.
    "session_id": pl.String(),
    "agent_id": pl.String(),
    # 0 for an agent's first request, then 1, 2, ... along its conversation.
    "turn": pl.Int32(),
    # The request whose conversation this one continues (null for a turn 0).
    "parent_id": pl.Int64(),
    # Seconds since the trace start on a global clock; null when the trace has none.
    "arrival_s": pl.Float64(),
    # Seconds since the session's first request was issued.
    "session_time_s": pl.Float64(),
    # Gap between the end of the parent's response and this request (tool run, human).
    "think_time_s": pl.Float64(),
    # How long the original call took, where recorded.
    "duration_s": pl.Float64(),
    "input_tokens": pl.Int64(),
    "output_tokens": pl.Int64(),
    "block_size": pl.Int32(),
    # Prefix-block ids, globally comparable within one trace: equal id, equal prefix block.
    "block_ids": pl.List(pl.Int64()),
    "trigger": TRIGGER_DTYPE,
    "model": pl.String(),
    # Key of the agent framework whose prompt template the session starts with.
    "framework": pl.String(),
    # Leading blocks of this request that belong to the framework's shared prompt.
    "shared_prefix_blocks": pl.Int32(),
}

COLUMNS = tuple(SCHEMA)


@dataclass(frozen=True)
class Trace:
    """A loaded trace: the request table plus what is known about how it was made."""

    requests: pl.DataFrame
    name: str
    source_format: str
    # True when arrival_s is a real clock shared by all sessions.
    has_clock: bool
    # True when session/parent structure was reconstructed rather than recorded.
    sessions_inferred: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Records the loader left out because it does not know their kind, counted by kind.
    skipped: Mapping[str, int] = field(default_factory=dict)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skipped_text(self) -> str:
        """``3 (type "?" 2, type "x" 1)``: how many records were left out, and of what kind."""
        kinds = ", ".join(f"type {kind!r} {n:,}" for kind, n in sorted(self.skipped.items()))
        return f"{self.num_skipped:,} ({kinds})" if self.skipped else "0"

    @property
    def num_requests(self) -> int:
        return self.requests.height

    @property
    def num_sessions(self) -> int:
        return self.requests["session_id"].n_unique()

    def with_requests(self, requests: pl.DataFrame) -> Trace:
        return replace(self, requests=requests)

    def block_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat block ids and per-request offsets, for loops that must not touch Python lists."""
        ids = self.requests["block_ids"]
        lengths = ids.list.len().fill_null(0).to_numpy()
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = ids.explode().drop_nulls().to_numpy() if offsets[-1] else np.empty(0, np.int64)
        return flat.astype(np.int64, copy=False), offsets


def finalize(frame: pl.DataFrame) -> pl.DataFrame:
    """Cast to the shared schema, fill defaults, number the rows and check invariants."""
    missing = [c for c in ("session_id", "input_tokens", "output_tokens") if c not in frame]
    if missing:
        raise ValueError(f"request table lacks required columns {missing}")
    defaults: dict[str, pl.Expr] = {
        "request_id": pl.int_range(pl.len(), dtype=pl.Int64),
        "agent_id": pl.lit("main"),
        "turn": pl.lit(0),
        "parent_id": pl.lit(None),
        "arrival_s": pl.lit(None),
        "session_time_s": pl.lit(None),
        "think_time_s": pl.lit(None),
        "duration_s": pl.lit(None),
        "block_size": pl.lit(16),
        "block_ids": pl.lit([], dtype=pl.List(pl.Int64())),
        "trigger": pl.lit(Trigger.UNKNOWN.value),
        "model": pl.lit(None),
        "framework": pl.lit(None),
        "shared_prefix_blocks": pl.lit(0),
    }
    frame = frame.with_columns(
        [expr.alias(name) for name, expr in defaults.items() if name not in frame]
    )
    return frame.select([pl.col(c).cast(t) for c, t in SCHEMA.items()])


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading positions where two block-id arrays agree."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


# A follow-up that keeps less than this share of its parent's blocks had its context
# rewritten: Claude Code's compaction replaces the history with a summary.
COMPACTION_KEEP_RATIO = 0.5
COMPACTION_MIN_PARENT_BLOCKS = 8


def is_compaction(parent_blocks: np.ndarray, blocks: np.ndarray) -> bool:
    """True when a follow-up's prefix shrinks sharply against its parent's."""
    if len(parent_blocks) < COMPACTION_MIN_PARENT_BLOCKS:
        return False
    kept = common_prefix_len(parent_blocks, blocks)
    return kept < COMPACTION_KEEP_RATIO * len(parent_blocks)
