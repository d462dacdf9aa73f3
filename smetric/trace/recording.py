"""Loader for a folder written by ``smetric serve --record`` (``smetric.record``).

The recording holds, per request, what one request shows (salted block ids, times, token
counts, turn, salted session and agent names, the body's trigger, engine and branch); the
structure between requests is put back here:

* a follow-up's parent is the request of the same agent one turn earlier whose blocks
  share the longest prefix with its own (the latest on a tie): an agent re-sends its
  conversation, so the previous turn's prompt opens this one;
* a sub-agent's first request (a harness named the spawning agent, or a new agent of a
  harness session) continues the spawning agent's latest earlier request;
* a follow-up that keeps less than half its parent's blocks is a compaction, the rule the
  Claude Code loader applies (``schema.is_compaction``);
* think time is exact: the gap from the parent's completion to this arrival.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import polars as pl

from smetric.trace.jsonl import block_columns, list_column
from smetric.trace.recording_format import (
    FORMAT,
    MANIFEST,
    METADATA_KEY,
    SEGMENT_GLOB,
    SEGMENT_SCHEMA,
)
from smetric.trace.schema import (
    Trace,
    TraceError,
    Trigger,
    common_prefix_len,
    finalize,
    is_compaction,
)

# Earlier requests of an agent compared with a follow-up when looking for its parent:
# enough for concurrent conversations that open alike, bounded for those that open alike
# by the thousand.
_CANDIDATES = 64
_TRIGGERS = frozenset(t.value for t in Trigger)


def is_recording(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def manifest(path: Path) -> dict:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise TraceError(path / MANIFEST, f"unreadable recording manifest: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TraceError(path / MANIFEST, f"not a {FORMAT} manifest")
    return data


def segments(path: Path) -> list[Path]:
    files = sorted(path.glob(SEGMENT_GLOB))
    if not files:
        raise TraceError(
            path,
            "the recording has no segments yet (they are written every "
            "--record-rotate seconds and when the router stops)",
        )
    return files


def read_segments(path: Path) -> tuple[pl.DataFrame, int]:
    """Every segment's rows in arrival order, each with its whole ``block_ids``, and the
    requests the recorder dropped."""
    salt_id = manifest(path).get("salt_id")
    frames, dropped = [], 0
    for file in segments(path):
        try:
            meta = json.loads(pl.read_parquet_metadata(file).get(METADATA_KEY, "{}"))
            frame = pl.read_parquet(file)
        except Exception as exc:  # polars raises several unrelated types for a bad file
            raise TraceError(file, f"not a readable recording segment: {exc}") from exc
        if meta.get("salt_id") != salt_id:
            raise TraceError(file, "segment salted differently from the recording's manifest")
        missing = [c for c in SEGMENT_SCHEMA if c not in frame.columns]
        if missing:
            raise TraceError(file, f"not a recording segment: missing columns {missing}")
        frame = frame.select([pl.col(c).cast(t) for c, t in SEGMENT_SCHEMA.items()])
        frames.append(frame.with_columns(_whole_blocks(frame, file)).drop(_STORED_BLOCKS))
        dropped = max(dropped, int(meta.get("dropped", 0)))
    rows = pl.concat(frames).sort("arrival_s", maintain_order=True)
    return rows, dropped


_STORED_BLOCKS = ("base_row", "shared_blocks", "new_block_ids")


def _whole_blocks(frame: pl.DataFrame, file: Path) -> pl.Series:
    """Each row's block ids: its base row's leading ``shared_blocks``, then its own."""
    blocks: list[np.ndarray] = []
    rows = zip(frame["base_row"], frame["shared_blocks"], frame["new_block_ids"], strict=True)
    for i, (base, shared, new) in enumerate(rows):
        own = new.to_numpy()
        if base is None:
            blocks.append(own)
            continue
        if not 0 <= base < i or shared > len(blocks[base]):
            raise TraceError(file, f"row {i} refers to a base row it cannot follow")
        blocks.append(np.concatenate([blocks[base][:shared], own]))
    flat, offsets = block_columns(blocks)
    return list_column(flat, offsets).alias("block_ids")


def _parents(rows: pl.DataFrame) -> tuple[list[int | None], list[bool]]:
    """Each request's parent row (None for a conversation's start) and whether it is a
    sub-agent's first request."""
    agents = rows["agent"].to_list()
    sessions = rows["session"].to_list()
    spawners = rows["parent_agent"].to_list()
    turns = rows["turn"].to_list()
    blocks = [np.asarray(b, dtype=np.int64) for b in rows["block_ids"].to_list()]
    by_agent_turn: dict[tuple[int, int], list[int]] = defaultdict(list)
    latest_of_agent: dict[int, int] = {}
    latest_of_session: dict[int, tuple[int, int]] = {}  # session -> (agent, row)
    first_agent: dict[int, int] = {}
    parents: list[int | None] = []
    spawned: list[bool] = []
    for i, (agent, session, spawner, turn) in enumerate(
        zip(agents, sessions, spawners, turns, strict=True)
    ):
        parent, child = None, False
        first_agent.setdefault(session, agent)
        if turn > 0:
            candidates = by_agent_turn.get((agent, turn - 1), [])[-_CANDIDATES:]
            best = -1
            for c in candidates:
                shared = common_prefix_len(blocks[c], blocks[i])
                if shared >= best:
                    parent, best = c, shared
        elif spawner is not None and spawner in latest_of_agent:
            parent, child = latest_of_agent[spawner], True
        elif agent != first_agent[session] and session in latest_of_session:
            other, row = latest_of_session[session]
            if other != agent:
                parent, child = row, True
        parents.append(parent)
        spawned.append(child)
        by_agent_turn[(agent, turn)].append(i)
        latest_of_agent[agent] = i
        latest_of_session[session] = (agent, i)
    return parents, spawned


def load(path: Path) -> Trace:
    info = manifest(path)
    rows, dropped = read_segments(path)
    parents, spawned = _parents(rows)
    blocks = [np.asarray(b, dtype=np.int64) for b in rows["block_ids"].to_list()]
    arrival = rows["arrival_s"].to_numpy()
    completion = rows["completion_s"].to_numpy()
    start = float(arrival.min())
    sessions = rows["session"].to_list()
    session_start: dict[int, float] = {}
    for session, at in zip(sessions, arrival.tolist(), strict=True):
        session_start.setdefault(session, at)
    triggers = []
    for i, (parent, child, said) in enumerate(
        zip(parents, spawned, rows["trigger"].to_list(), strict=True)
    ):
        if parent is not None and not child and is_compaction(blocks[parent], blocks[i]):
            triggers.append(Trigger.COMPACTION.value)
        elif child:
            triggers.append(Trigger.AGENT.value)
        else:
            triggers.append(said if said in _TRIGGERS else Trigger.UNKNOWN.value)
    think = [
        None if p is None else max(0.0, float(arrival[i] - completion[p]))
        for i, p in enumerate(parents)
    ]
    frame = pl.DataFrame(
        {
            "session_id": [f"{s & (2**64 - 1):016x}" for s in sessions],
            "agent_id": _agent_names(sessions, rows["agent"].to_list()),
            "turn": rows["turn"],
            "parent_id": pl.Series(parents, dtype=pl.Int64),
            "arrival_s": arrival - start,
            "session_time_s": [
                at - session_start[s] for s, at in zip(sessions, arrival, strict=True)
            ],
            "think_time_s": pl.Series(think, dtype=pl.Float64),
            "duration_s": completion - arrival,
            "input_tokens": rows["prompt_tokens"],
            "output_tokens": rows["output_tokens"].fill_null(0),
            "block_size": int(info.get("block_size", 16)),
            "block_ids": rows["block_ids"],
            "trigger": triggers,
        }
    )
    return Trace(
        requests=finalize(frame),
        name=path.name,
        source_format="recording",
        has_clock=True,
        sessions_inferred=True,
        notes=tuple(_notes(rows, info, dropped)),
    )


def _agent_names(sessions: list[int], agents: list[int]) -> list[str]:
    """``main`` for each session's first agent (the root, as the other loaders name it),
    the salted id for the sub-agents."""
    root: dict[int, int] = {}
    names = []
    for session, agent in zip(sessions, agents, strict=True):
        main = root.setdefault(session, agent) == agent
        names.append("main" if main else f"{agent & (2**64 - 1):016x}")
    return names


def _notes(rows: pl.DataFrame, info: dict, dropped: int) -> list[str]:
    reported = rows.filter(pl.col("cached_tokens").is_not_null())
    notes = [
        f"Recorded by smetric serve: {rows.height:,} requests over "
        f"{rows['engine'].n_unique()} engines, block ids salted (tokenizer "
        f"{info.get('tokenizer', '?')}, {info.get('block_size', 16)} tokens a block); parents "
        "and compactions inferred from block prefixes."
    ]
    if reported.height:
        share = int(reported["cached_tokens"].sum()) / max(int(reported["prompt_tokens"].sum()), 1)
        notes.append(
            f"Engines reported {share:.1%} of prompt tokens cached "
            f"({reported.height:,} requests reporting)."
        )
    if dropped:
        notes.append(f"The recorder dropped {dropped:,} requests it could not keep up with.")
    return notes
