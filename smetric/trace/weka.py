"""Loader for WEKA's Claude Code session traces (one JSON file per session, sub-agents inline).

The files have no global clock, so the loader does more than parse:

* a file marked ``"hash_id_scope": "local"`` (the default) has block ids that mean
  something only within that file: its ids get a namespace of their own (a dense offset
  per file), so the whole folder is one comparable id space, and the first
  ``(tool_tokens + system_tokens) // block_size`` blocks of each agent's first request are
  mapped onto a namespace shared by every agent of the same framework (same model, tool and
  system prompt sizes), so the template's reuse across sessions is visible, as the trace's
  README prescribes;
* a file marked ``"hash_id_scope": "global"`` has ids shared across sessions already
  (forked agents, shared files, resumed work): they are kept as they are, so the capture's
  own cross-session reuse is what every study and simulation sees;
* request records of a type this loader does not know are skipped and counted by type
  (``Trace.skipped``): public captures carry such records, and one of them must not cost
  the whole folder;
* each request is linked to the one it waits for: the previous call of the same agent, or
  for a sub-agent's first call, the parent-agent call that spawned it.
"""

from __future__ import annotations

import gzip
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import numpy as np
import polars as pl

from smetric.trace.schema import (
    Trace,
    TraceError,
    Trigger,
    common_prefix_len,
    finalize,
    is_compaction,
)

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class CallRecord(msgspec.Struct, tag_field="type"):
    """A session file's record of one API call, streamed (``s``) or not (``n``)."""

    t: float
    in_: NonNegInt = msgspec.field(name="in")
    out: NonNegInt = 0
    hash_ids: list[int] = msgspec.field(default_factory=list)
    model: str = ""
    input_types: list[str] = msgspec.field(default_factory=list)
    api_time: NonNegFloat | None = None
    think_time: float | None = None


class NonStreamingCall(CallRecord, tag="n"):
    pass


class StreamingCall(CallRecord, tag="s"):
    pass


class SubAgent(msgspec.Struct, tag_field="type", tag="subagent"):
    t: float
    # Decoded one by one (``_records``), so that a record of an unknown type is skipped.
    requests: list[msgspec.Raw]
    agent_id: str = ""
    models: list[str] = msgspec.field(default_factory=list)
    tool_tokens: NonNegInt = 0
    system_tokens: NonNegInt = 0


class SessionFile(msgspec.Struct):
    requests: list[msgspec.Raw]
    id: str = ""
    hash_id_scope: Literal["local", "global"] = "local"
    block_size: Annotated[int, msgspec.Meta(gt=0)] = 64
    models: list[str] = msgspec.field(default_factory=list)
    tool_tokens: NonNegInt = 0
    system_tokens: NonNegInt = 0


class _Kind(msgspec.Struct):
    """Only a record's type, read before deciding whether to decode the rest."""

    type: str = ""


Record = NonStreamingCall | StreamingCall | SubAgent
KNOWN_TYPES = ("n", "s", "subagent")

_DECODER = msgspec.json.Decoder(SessionFile)
_KIND = msgspec.json.Decoder(_Kind)
_RECORD = msgspec.json.Decoder(Record)
_BYTE_AT = re.compile(r"byte (\d+)")


def _records(
    raws: list[msgspec.Raw], where: str, skipped: Counter[str]
) -> list[tuple[str, Record]]:
    """The records of known types with their JSON paths, each decoded strictly; the
    others counted by type.

    ``where`` is the JSON path of the list, so that an error in one record names it as a
    decode of the whole file would.
    """
    records: list[tuple[str, Record]] = []
    for i, raw in enumerate(raws):
        at = f"{where}[{i}]"
        try:
            kind = _KIND.decode(raw).type
            if kind not in KNOWN_TYPES:
                skipped[kind] += 1
                continue
            records.append((at, _RECORD.decode(raw)))
        except msgspec.DecodeError as exc:
            raise ValueError(str(exc).replace("`$", f"`{at}", 1)) from exc
    return records


@dataclass
class _IdSpace:
    """Block ids: global-scope files' ids as they are, then a dense range per local-scope
    session file, then a range per framework prompt.

    Framework ids are handed out as negative placeholders while sessions load, because
    a session's range is known only once all its calls are read, and local ranges count
    from 0 because the largest global id is known only once every file is read;
    ``resolve`` moves both past what precedes them at the end.
    """

    next_id: int = 0
    frameworks: dict[str, np.ndarray] = field(default_factory=dict)
    placeholders: int = 0
    # The largest id of the global-scope files (-1: none).
    global_top: int = -1

    def framework_ids(self, key: str, count: int) -> np.ndarray:
        ids = self.frameworks.get(key)
        if ids is None or len(ids) < count:
            have = 0 if ids is None else len(ids)
            fresh = -1 - np.arange(self.placeholders, self.placeholders + count - have)
            self.placeholders += count - have
            ids = fresh if ids is None else np.concatenate([ids, fresh])
            self.frameworks[key] = ids
        return ids[:count]

    def resolve(self, blocks: np.ndarray, shared: int, local: bool) -> None:
        if not local:
            return
        base = self.global_top + 1
        blocks[shared:] += base
        blocks[:shared] = base + self.next_id - 1 - blocks[:shared]


@dataclass
class _Rows:
    """Column buffers for one trace, filled session by session."""

    session_id: list[str] = field(default_factory=list)
    agent_id: list[str] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    parent: list[int | None] = field(default_factory=list)
    session_time_s: list[float] = field(default_factory=list)
    think_time_s: list[float | None] = field(default_factory=list)
    duration_s: list[float | None] = field(default_factory=list)
    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    block_size: list[int] = field(default_factory=list)
    block_ids: list[np.ndarray] = field(default_factory=list)
    trigger: list[str] = field(default_factory=list)
    model: list[str] = field(default_factory=list)
    framework: list[str] = field(default_factory=list)
    shared_prefix_blocks: list[int] = field(default_factory=list)
    # Whether the row's ids are local to its file (so renamed when resolved).
    local: list[bool] = field(default_factory=list)

    def frame(self, order: np.ndarray) -> pl.DataFrame:
        """Rows reordered by ``order``, with parent indices renumbered to match."""
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        parents = [self.parent[i] for i in order]
        columns = {
            name: [values[i] for i in order]
            for name, values in vars(self).items()
            if name not in ("parent", "block_ids", "local")
        }
        columns["parent_id"] = [None if p is None else int(rank[p]) for p in parents]
        return pl.DataFrame(columns).with_columns(
            pl.Series("block_ids", [self.block_ids[i] for i in order], dtype=pl.List(pl.Int64))
        )


@dataclass
class _Agent:
    """One conversation inside a session: the root agent or a sub-agent."""

    agent_id: str
    start_s: float
    calls: list[msgspec.Raw]
    # JSON path of ``calls`` in the session file, for error messages.
    where: str
    model: str
    tool_tokens: int
    system_tokens: int
    spawner: int | None
    # Whether the session's ids are local to its file.
    local: bool


def _framework_key(model: str, tool_tokens: int, system_tokens: int) -> str:
    return f"{model}|tools={tool_tokens}|system={system_tokens}"


def _trigger(call: CallRecord, turn: int, spawned: bool, compaction: bool) -> Trigger:
    """User-typed turns carry only text; tool results mean the agent loop sent it."""
    if compaction:
        return Trigger.COMPACTION
    if "tool_result" in call.input_types or (turn == 0 and spawned):
        return Trigger.AGENT
    if "text" in call.input_types:
        return Trigger.USER
    return Trigger.UNKNOWN


def _add_session(
    session: SessionFile, name: str, ids: _IdSpace, rows: _Rows, skipped: Counter[str]
) -> None:
    start = len(rows.turn)
    root_model = session.models[0] if session.models else ""
    local = session.hash_id_scope == "local"
    pending = [
        _Agent(
            "main",
            0.0,
            session.requests,
            "$.requests",
            root_model,
            session.tool_tokens,
            session.system_tokens,
            None,
            local,
        )
    ]
    while pending:
        agent = pending.pop(0)
        _add_agent(agent, name, session.block_size, ids, rows, pending, skipped)
    largest = max((int(b.max()) for b in rows.block_ids[start:] if len(b)), default=-1)
    if local:
        ids.next_id = max(ids.next_id, largest + 1)
    else:
        ids.global_top = max(ids.global_top, largest)


def _add_agent(
    agent: _Agent,
    session_name: str,
    block_size: int,
    ids: _IdSpace,
    rows: _Rows,
    pending: list[_Agent],
    skipped: Counter[str],
) -> None:
    # Global-scope ids already say what is shared: no framework namespace is made up.
    prefix_len = (agent.tool_tokens + agent.system_tokens) // block_size if agent.local else 0
    first_own: np.ndarray | None = None
    previous: int | None = agent.spawner
    turn = 0
    records = _records(agent.calls, agent.where, skipped)
    for at, call in sorted(records, key=lambda r: r[1].t):
        t = agent.start_s + call.t
        if isinstance(call, SubAgent):
            model = call.models[0] if call.models else agent.model
            spawner = previous if previous is not None else agent.spawner
            pending.append(
                _Agent(
                    call.agent_id or f"{agent.agent_id}/sub{len(pending)}",
                    t,
                    call.requests,
                    f"{at}.requests",
                    model,
                    call.tool_tokens,
                    call.system_tokens,
                    spawner,
                    agent.local,
                )
            )
            continue
        own = np.asarray(call.hash_ids, dtype=np.int64)
        if len(own) and own.min() < 0:
            raise ValueError(f"negative block id in {at}.hash_ids")
        if first_own is None:
            first_own = own[:prefix_len]
        model = call.model or agent.model
        key = _framework_key(model, agent.tool_tokens, agent.system_tokens)
        shared = common_prefix_len(first_own, own)
        blocks = own + ids.next_id if agent.local else own
        blocks[:shared] = ids.framework_ids(key, len(first_own))[:shared]
        parent_blocks = rows.block_ids[previous] if previous is not None else None
        compaction = turn > 0 and parent_blocks is not None and is_compaction(parent_blocks, blocks)
        rows.session_id.append(session_name)
        rows.agent_id.append(agent.agent_id)
        rows.turn.append(turn)
        rows.parent.append(previous)
        rows.session_time_s.append(t)
        rows.think_time_s.append(_think_time(call, t, rows, previous))
        rows.duration_s.append(call.api_time)
        rows.input_tokens.append(call.in_)
        rows.output_tokens.append(call.out)
        rows.block_size.append(block_size)
        rows.block_ids.append(blocks)
        rows.trigger.append(_trigger(call, turn, agent.spawner is not None, compaction).value)
        rows.model.append(model)
        rows.framework.append(key)
        rows.shared_prefix_blocks.append(shared)
        rows.local.append(agent.local)
        previous = len(rows.turn) - 1
        turn += 1


def _think_time(call: CallRecord, t: float, rows: _Rows, parent: int | None) -> float | None:
    """The recorded gap when present, else derived from the parent's start and duration."""
    if parent is None:
        return None
    if call.think_time is not None:
        return call.think_time
    parent_duration = rows.duration_s[parent]
    if parent_duration is None:
        return None
    return max(0.0, t - rows.session_time_s[parent] - parent_duration)


def _read(path: Path) -> bytes:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError) as exc:
        raise TraceError(path, f"cannot read file: {exc}") from exc


def _decode(path: Path) -> SessionFile:
    data = _read(path)
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        message = str(exc)
        match = _BYTE_AT.search(message)
        line = data.count(b"\n", 0, int(match.group(1))) + 1 if match else None
        raise TraceError(path, message, line=line) from exc


def session_files(path: Path) -> list[Path]:
    """The session files of a folder (or the one file given), in name order."""
    if path.is_file():
        return [path]
    files = sorted(
        p for p in path.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz"))
    )
    if not files:
        raise TraceError(path, "folder holds no .json or .json.gz session files")
    return files


def load(path: Path, progress: Callable[[int], None] | None = None) -> Trace:
    """Load one session file or a folder of them; ``progress`` is told of each file done."""
    files = session_files(path)
    rows = _Rows()
    ids = _IdSpace()
    skipped: Counter[str] = Counter()
    for file in files:
        session = _decode(file)
        name = session.id or file.name.split(".")[0]
        try:
            _add_session(session, name, ids, rows, skipped)
        except ValueError as exc:
            raise TraceError(file, str(exc)) from exc
        if progress is not None:
            progress(1)
    if not rows.turn:
        left_out = f"; left out {sum(skipped.values())} of unknown types" if skipped else ""
        raise TraceError(path, f"no requests{left_out}")
    for blocks, shared, local in zip(
        rows.block_ids, rows.shared_prefix_blocks, rows.local, strict=True
    ):
        ids.resolve(blocks, shared, local)
    frame = finalize(rows.frame(_issue_order(rows)))
    return Trace(
        requests=frame,
        name=path.name,
        source_format="weka",
        has_clock=False,
        notes=_notes(local=any(rows.local), shared=ids.global_top >= 0),
        skipped=dict(skipped),
    )


def _notes(local: bool, shared: bool) -> tuple[str, ...]:
    notes = ["Sessions have no global clock: times are relative to each session's start."]
    if shared:
        notes.append(
            "Files marked hash_id_scope global keep their block ids as they are, so the "
            "reuse they share across sessions is the capture's own."
        )
    if local:
        notes.append(
            "Leading system/tool-prompt blocks of files with session-local ids are mapped to "
            "a namespace shared per (model, tool_tokens, system_tokens), as the trace's "
            "README prescribes."
        )
    return tuple(notes)


def _issue_order(rows: _Rows) -> np.ndarray:
    """Sessions in file order; within one, by time, the parent before its children."""
    session_rank = {s: i for i, s in enumerate(dict.fromkeys(rows.session_id))}
    keys = [session_rank[s] for s in rows.session_id]
    return np.lexsort((np.arange(len(keys)), np.asarray(rows.session_time_s), np.asarray(keys)))
