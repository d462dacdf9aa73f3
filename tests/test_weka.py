import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from smetric.trace import weka
from smetric.trace.schema import TraceError

from conftest import real_trace


def session(sid: str, requests: list, tool: int = 64, system: int = 64) -> dict:
    return {
        "id": sid,
        "models": ["m"],
        "block_size": 64,
        "hash_id_scope": "local",
        "tool_tokens": tool,
        "system_tokens": system,
        "requests": requests,
    }


def call(t: float, ids: list[int], kind: str = "tool_result", **extra) -> dict:
    return {
        "t": t,
        "type": "n",
        "model": "m",
        "in": 64 * len(ids) + 10,
        "out": 5,
        "hash_ids": ids,
        "input_types": [kind],
        "api_time": 1.0,
        "think_time": 2.0,
        **extra,
    }


def write(folder: Path, name: str, data: dict, gz: bool = True) -> Path:
    path = folder / (name + (".json.gz" if gz else ".json"))
    raw = json.dumps(data).encode()
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    # Two sessions of one framework (2 shared prompt blocks: (64 + 64) // 64), one with a
    # sub-agent spawned after its first call, and a compaction in the second session.
    write(
        tmp_path,
        "a",
        session(
            "a",
            [
                call(0.0, [1, 2, 3], "text"),
                {
                    "t": 5.0,
                    "type": "subagent",
                    "agent_id": "agent_1",
                    "models": ["m"],
                    "tool_tokens": 0,
                    "system_tokens": 64,
                    "requests": [call(0.0, [50, 51], "text"), call(3.0, [50, 51, 52])],
                },
                call(10.0, [1, 2, 3, 4]),
            ],
        ),
    )
    write(
        tmp_path,
        "b",
        session(
            "b",
            [
                call(0.0, [1, 2, 7, 8, 9, 10, 11, 12, 13, 14], "text"),
                call(4.0, [1, 2, 7, 8, 9, 10, 11, 12, 13, 14, 15]),
                call(9.0, [1, 2, 30]),
            ],
        ),
        gz=False,
    )
    return tmp_path


def test_folder_loads_sessions_subagents_and_links(folder: Path) -> None:
    trace = weka.load(folder)
    df = trace.requests
    assert trace.has_clock is False
    assert df["session_id"].to_list() == ["a"] * 4 + ["b"] * 3
    # Session a, by time: main t=0, sub-agent t=5 and 8, main t=10.
    assert df["agent_id"].to_list()[:4] == ["main", "agent_1", "agent_1", "main"]
    assert df["session_time_s"].to_list()[:4] == [0.0, 5.0, 8.0, 10.0]
    assert df["turn"].to_list() == [0, 0, 1, 1, 0, 1, 2]
    # The sub-agent's first call waits for the main call that spawned it (row 0).
    assert df["parent_id"].to_list() == [None, 0, 1, 0, None, 4, 5]
    assert df["trigger"].to_list() == [
        "user",
        "agent",  # a sub-agent's first prompt is written by its parent agent
        "agent",
        "agent",
        "user",
        "agent",
        "compaction",  # keeps 2 of its parent's 11 blocks
    ]


def test_block_namespaces_and_shared_framework_prompt(folder: Path) -> None:
    df = weka.load(folder).requests
    blocks = df["block_ids"].to_list()
    # Both sessions' first two blocks are the framework's shared prompt: same ids.
    assert blocks[0][:2] == blocks[4][:2]
    assert df["shared_prefix_blocks"].to_list()[0] == 2
    # Local id 3 in session a and local id 7.. in session b never collide, even though
    # local ids repeat across files.
    a_ids = {i for row in blocks[:4] for i in row[2:]}
    b_ids = {i for row in blocks[4:] for i in row[2:]}
    assert not a_ids & b_ids
    # Follow-ups extend their parent's ids exactly.
    assert blocks[3][:3] == blocks[0]
    # The sub-agent (another framework: 0 + 64 tokens -> 1 block) shares nothing with main.
    assert not set(blocks[1]) & set(blocks[0])
    # framework prompt 2, a main 2, sub-agent 1 framework + 2, b 9 + its compaction 1
    assert len(set(np.concatenate([np.array(b) for b in blocks]))) == 2 + 2 + 3 + 9 + 1


def test_single_file_and_think_time_fallback(tmp_path: Path) -> None:
    first = call(0.0, [1, 2])
    second = call(7.0, [1, 2, 3])
    del second["think_time"]
    path = write(tmp_path, "s", session("s", [first, second]))
    df = weka.load(path).requests
    # No recorded think time: the gap after the parent's 1 s call, 7 - 0 - 1.
    assert df["think_time_s"].to_list() == [None, 6.0]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["requests"][0].pop("in"), "missing required field `in`"),
        (lambda d: d["requests"][0].update({"in": -5}), "`$.requests[0].in`"),
        (lambda d: d["requests"][0].update({"type": "weird"}), "left out 1 of unknown types"),
        (lambda d: d["requests"][0].update({"out": "x"}), "`$.requests[0].out`"),
        (lambda d: d["requests"][0].update({"hash_ids": [1, -2]}), "negative block id"),
    ],
)
def test_bad_session_file_is_located(tmp_path: Path, mutate, message: str) -> None:
    data = session("s", [call(0.0, [1, 2])])
    mutate(data)
    path = write(tmp_path, "bad", data)
    with pytest.raises(TraceError) as err:
        weka.load(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_corrupt_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"id": "x",\n "requests": [\n {"t": 0, oops}]}')
    with pytest.raises(TraceError) as err:
        weka.load(path)
    assert err.value.line == 3


def test_truncated_gzip_and_empty_folder(tmp_path: Path) -> None:
    path = tmp_path / "cut.json.gz"
    path.write_bytes(gzip.compress(b'{"requests": []}' * 50)[:20])
    with pytest.raises(TraceError, match="cannot read"):
        weka.load(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match=r"no \.json"):
        weka.load(empty)


def test_whole_real_folder_loads() -> None:
    trace = weka.load(real_trace("weka-claude-code"))
    df = trace.requests
    assert trace.num_sessions == 637
    assert df.height == 43_767
    lengths = df["block_ids"].list.len().to_numpy()
    assert (lengths == df["input_tokens"].to_numpy() // 64).all()
    assert df["parent_id"].null_count() == 637  # one root per session


def unknown(t: float) -> dict:
    """A record of a type the loader does not know, without hash_ids, as public captures hold."""
    return {"t": t, "type": "?", "in": 100, "out": 3}


def test_unknown_record_types_are_skipped_and_counted(tmp_path: Path) -> None:
    sub = {
        "t": 5.0,
        "type": "subagent",
        "agent_id": "agent_1",
        "requests": [call(0.0, [50, 51], "text"), unknown(1.0)],
    }
    write(tmp_path, "a", session("a", [call(0.0, [1, 2, 3], "text"), unknown(1.0), sub]))
    write(tmp_path, "b", session("b", [{"t": 2.0, "type": "x"}, call(3.0, [1, 2], "text")]))
    trace = weka.load(tmp_path)
    assert trace.num_requests == 3
    assert trace.skipped == {"?": 2, "x": 1}
    assert trace.skipped_text() == "3 (type '?' 2, type 'x' 1)"
    # The sub-agent's first call still waits for the call that spawned it.
    assert trace.requests["parent_id"].to_list() == [None, 0, None]


def global_session(sid: str, requests: list) -> dict:
    return {**session(sid, requests), "hash_id_scope": "global"}


# Three sessions whose ids are shared across sessions: b forks a's context after a's
# second turn, c shares only the opening system blocks 1, 2 with a.
GLOBAL_SESSIONS = {
    "a": [call(0.0, [1, 2, 3], "text"), call(4.0, [1, 2, 3, 4, 5]), call(9.0, [1, 2, 3, 4, 5, 6])],
    "b": [call(0.0, [1, 2, 3, 4, 5, 20], "text"), call(6.0, [1, 2, 3, 4, 5, 20, 21])],
    "c": [call(0.0, [1, 2, 40], "text"), unknown(1.0), call(2.0, [1, 2, 40, 41])],
}


@pytest.fixture
def global_folder(tmp_path: Path) -> Path:
    for name, requests in GLOBAL_SESSIONS.items():
        write(tmp_path, name, global_session(name, requests))
    return tmp_path


def test_global_scope_ids_are_used_as_they_are(global_folder: Path) -> None:
    trace = weka.load(global_folder)
    written = [c["hash_ids"] for rs in GLOBAL_SESSIONS.values() for c in rs if c["type"] == "n"]
    assert trace.requests["block_ids"].to_list() == written
    # No synthetic system-prompt namespace on top of ids that already say what is shared.
    assert trace.requests["shared_prefix_blocks"].to_list() == [0] * len(written)
    assert trace.skipped == {"?": 1}
    assert any("hash_id_scope global" in note for note in trace.notes)


def test_mixed_scopes_keep_global_ids_and_separate_local_ones(global_folder: Path) -> None:
    write(global_folder, "d", session("d", [call(0.0, [1, 2, 3], "text")]))
    blocks = weka.load(global_folder).requests["block_ids"].to_list()
    global_ids = {i for row in blocks[:-1] for i in row}
    # The local file's framework prompt (2 blocks) and its own block share nothing with
    # the global ids, though its local ids 1, 2, 3 are written the same.
    assert not set(blocks[-1]) & global_ids
    assert blocks[:-1] == [
        c["hash_ids"] for rs in GLOBAL_SESSIONS.values() for c in rs if c["type"] == "n"
    ]


def independent_cross_session_share(sessions: dict[str, list]) -> float:
    """Replay sessions in file order against an infinite store, each block remembering the
    session that first sent it; the share of hit tokens first sent by another session."""
    producer: dict[int, str] = {}
    hits = cross = 0
    for name, requests in sessions.items():
        for c in sorted((c for c in requests if c["type"] == "n"), key=lambda c: c["t"]):
            ids = c["hash_ids"]
            run = 0
            while run < len(ids) and ids[run] in producer:
                run += 1
            hits += 64 * run
            cross += 64 * sum(producer[i] != name for i in ids[:run])
            for i in ids:
                producer.setdefault(i, name)
    return cross / hits


def test_analyze_reports_the_traces_own_cross_session_reuse(global_folder: Path) -> None:
    from smetric.trace.analysis import AnalysisOptions, analyze

    result = analyze(weka.load(global_folder), AnalysisOptions(instances=2, layout_s=10))
    expected = independent_cross_session_share(GLOBAL_SESSIONS)
    assert expected > 0.5  # b's fork and c's shared opening
    assert result.reuse.cross_session_share == pytest.approx(expected)
    assert result.trace.skipped == {"?": 1}
    # Read as session-local ids, the same files show no reuse across sessions beyond the
    # framework prompt: what the scope marker changes.
    for name, requests in GLOBAL_SESSIONS.items():
        write(global_folder, name, session(name, requests))
    local = analyze(weka.load(global_folder), AnalysisOptions(instances=2, layout_s=10))
    assert local.reuse.cross_session_share is not None
    assert local.reuse.cross_session_share < expected


def test_composed_workload_carries_global_sharing(global_folder: Path) -> None:
    from smetric.trace.compose import compose_sessions

    trace = weka.load(global_folder)
    workload = compose_sessions(trace, rate=1.0, num_sessions=6, seed=1)
    first = {
        int(workload.source[r]): workload.block_ids(r).tolist()
        for r in range(workload.num_requests)
        if workload.copy[r] == 0
    }
    # Every session's first draw issues the trace's own ids, so b still hits a's context.
    assert first == dict(enumerate(trace.requests["block_ids"].to_list()))


def test_trace_info_says_how_many_records_it_skipped(global_folder: Path) -> None:
    from typer.testing import CliRunner

    from smetric.cli import app

    result = CliRunner().invoke(app, ["trace", "info", str(global_folder), "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert "skipped records,1 (type '?' 1)" in result.output
