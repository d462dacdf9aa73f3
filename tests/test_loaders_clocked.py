"""Loaders for the traces with a global clock: Mooncake, Bailian and Azure.

Small files are written here with answers worked out by hand; the real public traces are
loaded too when the shared folder is present.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from smetric.trace import azure, bailian, mooncake
from smetric.trace.schema import SCHEMA, Trace, TraceError
from smetric.trace.sessions import ParentCycleError, chain_roots, infer_sessions

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def parents_of(*requests: list[int]) -> list[int]:
    return infer_sessions([np.array(r, dtype=np.int64) for r in requests]).tolist()


def write_jsonl(path: Path, rows: list[dict[str, Any] | str]) -> Path:
    """Rows as JSON lines; a string is written as it is (for blank and corrupt lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def column(trace: Trace, name: str) -> list[Any]:
    return trace.requests[name].to_list()


# --- session inference ---------------------------------------------------------------


def test_chain_of_three_turns_follows_the_longest_prefix() -> None:
    # Turn 2 matches turn 0 (3 blocks) and turn 1 (4 blocks): the longer match wins.
    assert parents_of([0, 1, 2, 3], [0, 1, 2, 4, 5], [0, 1, 2, 4, 6, 7]) == [-1, 0, 1]


def test_sessions_sharing_only_block_zero_stay_apart() -> None:
    # [0, 2, 3] starts with all of [0, 1] but its last, yet one shared block is no evidence.
    assert parents_of([0, 1], [0, 2, 3], [0, 4], [0, 1, 5]) == [-1, -1, -1, -1]


def test_a_prefix_owned_by_another_session_is_no_match() -> None:
    # [0, 1, 9] is a new session whose prefix [0, 1] was written by the first one, so a
    # later [0, 1, 7, 8] must not chain to it (nor to [0, 1, 2, 3]: 2 != 7).
    assert parents_of([0, 1, 2, 3], [0, 1, 9], [0, 1, 7, 8]) == [-1, -1, -1]


def test_a_regenerated_turn_branches_from_the_same_parent() -> None:
    assert parents_of([10, 11, 12, 13], [10, 11, 12, 20, 21], [10, 11, 12, 30]) == [-1, 0, 0]


def test_ties_go_to_the_most_recent_and_length_beats_recency() -> None:
    requests = [
        [10, 11, 12],  # 0: root
        [10, 11, 12, 13, 14],  # 1: continues 0 (prefix [10, 11])
        [10, 11, 16],  # 2: also continues 0, and now the latest with prefix [10, 11]
        [10, 11, 12, 13, 17],  # 3: 1 matches 4 blocks, 2 only 2: the longer wins
        [10, 11, 18, 19],  # 4: 0 and 2 tie on [10, 11]: the latest, 2, wins
    ]
    assert parents_of(*requests) == [-1, 0, 0, 1, 2]


def test_the_partial_last_block_may_change() -> None:
    # The next turn rewrites the parent's last (partial) block: still the same session.
    assert parents_of([5, 6, 7], [5, 6, 8, 9]) == [-1, 0]


def test_flat_form_matches_list_form_and_empty_requests_are_roots() -> None:
    requests = [[0, 1, 2, 3], [], [0, 1, 2, 4, 5], [0, 1, 2, 4, 6, 7]]
    flat = np.array([b for r in requests for b in r], dtype=np.int64)
    offsets = np.cumsum([0] + [len(r) for r in requests])
    assert infer_sessions(flat, offsets).tolist() == parents_of(*requests) == [-1, -1, 0, 2]
    assert infer_sessions([]).tolist() == []


def test_chain_roots_walks_parents_in_any_order_and_rejects_loops() -> None:
    roots, depths = chain_roots([2, -1, 1, 0])
    assert roots.tolist() == [1, 1, 1, 1]
    assert depths.tolist() == [2, 0, 1, 3]
    with pytest.raises(ParentCycleError):
        chain_roots([-1, 2, 1])


# --- Mooncake ------------------------------------------------------------------------


def mooncake_row(ms: int, blocks: list[int], tokens: int = 1000, out: int = 10) -> dict[str, Any]:
    return {"timestamp": ms, "input_length": tokens, "output_length": out, "hash_ids": blocks}


def test_mooncake_loads_inferred_sessions(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "trace.jsonl",
        [
            mooncake_row(0, [0, 1, 2]),
            mooncake_row(3000, [0, 1, 3, 4], tokens=1800, out=20),
            "",
            # Out of order in the file: rows are put in arrival order.
            {**mooncake_row(1000, [0, 7, 8]), "extra": "ignored"},
            mooncake_row(6000, [0, 1, 3, 5, 6]),
        ],
    )
    trace = mooncake.load(path)
    assert trace.requests.schema == pl.Schema(SCHEMA)
    assert (trace.source_format, trace.has_clock, trace.sessions_inferred) == (
        "mooncake",
        True,
        True,
    )
    assert any("inferred" in note for note in trace.notes)
    assert column(trace, "request_id") == [0, 1, 2, 3]
    assert column(trace, "arrival_s") == [0.0, 1.0, 3.0, 6.0]
    assert column(trace, "session_id") == ["s0", "s1", "s0", "s0"]
    assert column(trace, "turn") == [0, 0, 1, 2]
    assert column(trace, "parent_id") == [None, None, 0, 2]
    assert column(trace, "session_time_s") == [0.0, 0.0, 3.0, 6.0]
    assert column(trace, "think_time_s") == [None, None, 3.0, 3.0]
    assert column(trace, "input_tokens") == [1000, 1000, 1800, 1000]
    assert column(trace, "block_ids")[1] == [0, 7, 8]
    assert set(column(trace, "block_size")) == {512}
    assert set(column(trace, "trigger")) == {"unknown"}
    assert set(column(trace, "duration_s")) == {None}


GOOD_MOONCAKE = json.dumps(mooncake_row(0, [0, 1]))


@pytest.mark.parametrize(
    ("bad_line", "says"),
    [
        ('{"timestamp": 0, "input_length": ', "truncated"),
        ('{"timestamp": 0 "input_length": 5}', "malformed"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "hash_ids"),
        (
            '{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": []}',
            "input_length",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": []}',
            "output_length",
        ),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-3]}', "hash_ids"),
        (
            '{"timestamp": "soon", "input_length": 5, "output_length": 1, "hash_ids": []}',
            "timestamp",
        ),
        ("[1, 2]", "object"),
    ],
)
def test_mooncake_bad_line_is_located(tmp_path: Path, bad_line: str, says: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD_MOONCAKE, "", bad_line, GOOD_MOONCAKE])
    with pytest.raises(TraceError) as caught:
        mooncake.load(path)
    assert caught.value.line == 3
    assert caught.value.path == str(path)
    assert says in caught.value.reason


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_mooncake_without_requests_is_rejected(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match="no requests"):
        mooncake.load(path)


def test_gzipped_jsonl_loads_like_plain(tmp_path: Path) -> None:
    plain = write_jsonl(tmp_path / "t.jsonl", [mooncake_row(0, [0, 1, 2]), mooncake_row(5, [0, 1])])
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert mooncake.load(packed).requests.equals(mooncake.load(plain).requests)


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        mooncake.load(tmp_path / "absent.jsonl")


# --- Bailian -------------------------------------------------------------------------


def bailian_row(
    chat: int, parent: int | None, t: float, turn: int, blocks: list[int], kind: str = "text"
) -> dict[str, Any]:
    return {
        "chat_id": chat,
        "parent_chat_id": parent,
        "timestamp": t,
        "input_length": 16 * len(blocks),
        "output_length": 8,
        "type": kind,
        "turn": turn,
        "hash_ids": blocks,
    }


def test_bailian_follows_recorded_parents(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "qwen.jsonl",
        [
            bailian_row(1, -1, 0.5, 1, [1, 2, 3]),
            bailian_row(2, 1, 2.0, 2, [1, 2, 3, 4, 5]),
            bailian_row(9, None, 1.0, 1, [1, 6], kind="image"),
            bailian_row(3, 2, 4.5, 3, [1, 2, 3, 4, 7]),
            # Its parent fell before the trace window: a root, counted in the notes.
            bailian_row(5, 77, 3.0, 4, [8, 9]),
        ],
    )
    trace = bailian.load(path)
    assert trace.requests.schema == pl.Schema(SCHEMA)
    assert (trace.source_format, trace.has_clock, trace.sessions_inferred) == (
        "bailian",
        True,
        False,
    )
    assert column(trace, "arrival_s") == [0.5, 1.0, 2.0, 3.0, 4.5]
    assert column(trace, "session_id") == ["1", "9", "1", "5", "1"]
    assert column(trace, "turn") == [0, 0, 1, 3, 2]
    assert column(trace, "parent_id") == [None, None, 0, None, 2]
    assert column(trace, "session_time_s") == [0.0, 0.0, 1.5, 0.0, 4.0]
    assert column(trace, "think_time_s") == [None, None, 1.5, None, 2.5]
    assert column(trace, "block_ids")[4] == [1, 2, 3, 4, 7]
    assert set(column(trace, "agent_id")) == {"main"}
    assert set(column(trace, "block_size")) == {16}
    assert set(column(trace, "trigger")) == {"unknown"}
    assert any(note.startswith("1 request") for note in trace.notes)


def test_bailian_missing_parent_field_means_root_and_zero_based_turns_are_kept(
    tmp_path: Path,
) -> None:
    root = bailian_row(1, None, 0.0, 0, [1, 2])
    del root["parent_chat_id"]
    path = write_jsonl(tmp_path / "q.jsonl", [root, bailian_row(2, 1, 1.0, 1, [1, 2, 3])])
    trace = bailian.load(path)
    assert column(trace, "turn") == [0, 1]
    assert column(trace, "parent_id") == [None, 0]
    assert not any("absent" in note for note in trace.notes)


def test_bailian_puts_a_parent_before_its_child_on_equal_timestamps(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [bailian_row(2, 1, 1.0, 2, [1, 2, 3]), bailian_row(1, -1, 1.0, 1, [1, 2])],
    )
    trace = bailian.load(path)
    assert column(trace, "session_id") == ["1", "1"]
    assert column(trace, "parent_id") == [None, 0]
    assert column(trace, "think_time_s") == [None, 0.0]


def test_bailian_marks_compaction(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [
            bailian_row(1, -1, 0.0, 1, list(range(1, 11))),
            # Keeps 2 of its parent's 10 blocks: the context was rewritten.
            bailian_row(2, 1, 1.0, 2, [1, 2, 50, 51]),
            # Its parent is too short to call a shrink a compaction.
            bailian_row(3, 2, 2.0, 3, [60]),
        ],
    )
    assert column(bailian.load(path), "trigger") == ["unknown", "compaction", "unknown"]


GOOD_BAILIAN = json.dumps(bailian_row(1, -1, 0.0, 1, [1, 2]))


@pytest.mark.parametrize(
    ("bad_line", "says"),
    [
        ('{"chat_id": 2, "parent_chat_id": -1, "timestamp": 1.0', "truncated"),
        (
            json.dumps({k: v for k, v in bailian_row(2, -1, 1.0, 1, []).items() if k != "turn"}),
            "turn",
        ),
        (json.dumps({**bailian_row(2, -1, 1.0, 1, []), "chat_id": "two"}), "chat_id"),
        (json.dumps({**bailian_row(2, -1, 1.0, 1, []), "input_length": -5}), "input_length"),
        (json.dumps({**bailian_row(2, -1, 1.0, 1, []), "type": 3}), "type"),
        (json.dumps(bailian_row(1, -1, 1.0, 1, [])), "already used on line 1"),
    ],
)
def test_bailian_bad_line_is_located(tmp_path: Path, bad_line: str, says: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD_BAILIAN, bad_line])
    with pytest.raises(TraceError) as caught:
        bailian.load(path)
    assert caught.value.line == 2
    assert says in caught.value.reason


def test_bailian_parent_loop_is_rejected(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "loop.jsonl",
        [bailian_row(1, 2, 0.0, 1, [1]), bailian_row(2, 1, 1.0, 2, [1, 2])],
    )
    with pytest.raises(TraceError, match="loop") as caught:
        bailian.load(path)
    assert caught.value.line in (1, 2)


def test_bailian_without_requests_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        bailian.load(path)


# --- Azure ---------------------------------------------------------------------------

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write_csv(path: Path, *rows: str) -> Path:
    path.write_text(AZURE_HEADER + "".join(r + "\n" for r in rows))
    return path


def test_azure_loads_single_request_sessions(tmp_path: Path) -> None:
    path = write_csv(
        tmp_path / "azure.csv",
        "2023-11-16 18:15:46.6805900,374,44",
        "2023-11-16 18:15:50.9951690,396,109",
        "2023-11-16 18:15:47,10,2",
        "2023-11-16 18:15:46.6805901,7,1",
    )
    trace = azure.load(path)
    assert trace.requests.schema == pl.Schema(SCHEMA)
    assert (trace.source_format, trace.has_clock, trace.sessions_inferred) == (
        "azure",
        True,
        False,
    )
    assert any("reuse cannot be measured" in note for note in trace.notes)
    # Seven fractional digits: the last row is 100 ns after the first.
    assert column(trace, "arrival_s") == pytest.approx([0.0, 1e-7, 0.31941, 4.314579], abs=1e-9)
    assert column(trace, "input_tokens") == [374, 7, 10, 396]
    assert column(trace, "output_tokens") == [44, 1, 2, 109]
    assert column(trace, "session_id") == ["r0", "r1", "r2", "r3"]
    assert column(trace, "block_ids") == [[], [], [], []]
    assert set(column(trace, "turn")) == {0}
    assert set(column(trace, "parent_id")) == {None}
    assert set(column(trace, "block_size")) == {16}
    assert set(column(trace, "trigger")) == {"unknown"}


@pytest.mark.parametrize(
    ("rows", "line", "says"),
    [
        (("2023-11-16 18:15:46.68,1,1", "yesterday,1,1"), 3, "TIMESTAMP"),
        (("2023-11-16 18:15:46.68,-4,1",), 2, "ContextTokens"),
        (("2023-11-16 18:15:46.68,4,1", "2023-11-16 18:15:47.1,4,2.5"), 3, "GeneratedTokens"),
        # The earliest bad line is reported, whichever column it is in.
        (("2023-11-16 18:15:46.68,4,x", "2023-11-16 18:15:47.1,y,1"), 2, "GeneratedTokens"),
    ],
)
def test_azure_bad_cell_is_located(
    tmp_path: Path, rows: tuple[str, ...], line: int, says: str
) -> None:
    with pytest.raises(TraceError) as caught:
        azure.load(write_csv(tmp_path / "bad.csv", *rows))
    assert caught.value.line == line
    assert says in caught.value.reason


def test_azure_missing_column_or_rows_is_rejected(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,4\n")
    with pytest.raises(TraceError, match="GeneratedTokens"):
        azure.load(wrong)
    with pytest.raises(TraceError, match="no requests"):
        azure.load(write_csv(tmp_path / "header_only.csv"))
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(TraceError, match="no requests"):
        azure.load(empty)


# --- the real traces -----------------------------------------------------------------


def check_invariants(trace: Trace) -> None:
    frame = trace.requests
    assert frame.schema == pl.Schema(SCHEMA)
    assert frame["request_id"].to_list() == list(range(frame.height))
    assert frame["arrival_s"].is_sorted()
    assert frame["arrival_s"][0] >= 0
    earliest = frame["session_time_s"].min()
    assert isinstance(earliest, float) and earliest >= 0
    assert (frame["input_tokens"] >= 0).all() and (frame["output_tokens"] >= 0).all()
    children = frame.filter(pl.col("parent_id").is_not_null())
    assert (children["parent_id"] < children["request_id"]).all()
    assert (children["think_time_s"] >= 0).all()
    assert (children["turn"] > 0).all()


def real_trace(relative: str) -> Path:
    path = TRACES / relative
    if not path.exists():
        pytest.skip(f"public trace {path} not present (the shared traces folder is optional)")
    return path


def test_real_mooncake_trace() -> None:
    trace = mooncake.load(real_trace("mooncake/conversation_trace.jsonl"))
    assert trace.num_requests == 12_031
    check_invariants(trace)
    frame = trace.requests
    expected_blocks = (frame["input_tokens"] + 511) // 512
    assert (frame["block_ids"].list.len() == expected_blocks).all()
    chained = frame["parent_id"].is_not_null().sum()
    # Most requests are single-turn, but a good share continue an earlier one.
    assert 1_000 < chained < 6_000
    assert trace.num_sessions == trace.num_requests - chained


def test_real_azure_trace() -> None:
    trace = azure.load(real_trace("azure-2023/AzureLLMInferenceTrace_conv.csv"))
    assert trace.num_requests == trace.num_sessions == 19_366
    check_invariants(trace)
    assert trace.requests["arrival_s"][0] == 0.0
    assert trace.requests["block_ids"].list.len().max() == 0
