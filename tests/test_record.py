"""The recorder's files (rotation, disk bound, salting, nothing else) and their loader."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from smetric.core.blocks import chain_hashes
from smetric.record.recorder import RecordedRequest, Recorder, RecordSettings, read_salt
from smetric.record.salt import siphash24
from smetric.record.trigger import body_trigger
from smetric.trace.load import count_units, detect_format, load_trace
from smetric.trace.recording_format import MANIFEST, SEGMENT_GLOB
from smetric.trace.schema import Trigger

SALT = b"a deployment's salt, 32 bytes.."
BS = 4


def blocks(*pieces: list[int]) -> np.ndarray:
    return chain_hashes(np.concatenate([np.asarray(p) for p in pieces]), BS)


def observation(
    at: float,
    ids: np.ndarray,
    turn: int,
    conversation: str,
    *,
    session: str | None = None,
    agent: str | None = None,
    parent_agent: str | None = None,
) -> RecordedRequest:
    return RecordedRequest(
        arrival_s=at,
        completion_s=at + 0.5,
        blocks=ids,
        prompt_tokens=len(ids) * BS + 2,
        output_tokens=7,
        cached_tokens=None,
        turn=turn,
        conversation=conversation,
        engine="http://127.0.0.1:9001",
        branch="sticky" if turn else "first_turn_balance",
        trigger=Trigger.USER,
        session=session,
        agent=agent,
        parent_agent=parent_agent,
    )


def recorder(folder: Path, salt: bytes = SALT, **settings) -> Recorder:
    return Recorder(RecordSettings(folder, salt=salt, block_size=BS, **settings))


def record(folder: Path, observations: list[RecordedRequest], **settings) -> Recorder:
    rec = recorder(folder, **settings)
    rec.start()
    for o in observations:
        rec.observe(o)
    rec.close()
    return rec


SYSTEM = list(range(1, 33))  # 8 blocks every conversation opens with


def conversation(name: str, seed: int, turns: int, start: float) -> list[RecordedRequest]:
    """An agent re-sending its growing conversation, turn after turn."""
    rng = np.random.default_rng(seed)
    tokens, out = list(SYSTEM), []
    for turn in range(turns):
        tokens += rng.integers(100, 10_000, size=12).tolist()
        out.append(observation(start + 10 * turn, blocks(tokens), turn, name))
    return out


def test_a_recording_loads_with_its_conversations_linked(tmp_path: Path) -> None:
    a = conversation("a", 1, 4, 0.0)
    b = conversation("b", 2, 3, 5.0)
    # A compaction: the history replaced by a short summary (turn keeps counting).
    summary = blocks(SYSTEM, [7, 7, 7, 7])
    squeezed = observation(45.0, summary, 4, "a")
    record(tmp_path, [*a, *b, squeezed])
    assert detect_format(tmp_path) == "recording" and count_units(tmp_path) == 1
    trace = load_trace(tmp_path)
    rows = trace.requests
    assert trace.has_clock and trace.sessions_inferred and trace.source_format == "recording"
    assert rows.height == 8 and rows["session_id"].n_unique() == 2
    assert rows["arrival_s"].to_list() == sorted(rows["arrival_s"].to_list())
    assert rows["arrival_s"][0] == 0.0
    by_time = {r["arrival_s"]: r for r in rows.iter_rows(named=True)}
    # Each follow-up continues its own agent's previous turn, never the other agent's.
    assert by_time[10.0]["parent_id"] == rows["arrival_s"].to_list().index(0.0)
    assert by_time[15.0]["parent_id"] == rows["arrival_s"].to_list().index(5.0)
    # Think time is exact: the previous turn completed 0.5 s after it arrived.
    assert by_time[10.0]["think_time_s"] == pytest.approx(9.5)
    assert by_time[10.0]["duration_s"] == pytest.approx(0.5)
    assert by_time[45.0]["trigger"] == "compaction"
    assert by_time[20.0]["trigger"] == "user"
    assert rows["block_size"].unique().to_list() == [BS]


def test_ids_are_salted_and_nothing_else_is_written(tmp_path: Path) -> None:
    obs = conversation("the user's secret opening", 3, 2, 0.0)
    obs.append(observation(30.0, obs[-1].blocks, 2, "x", session="sess-secret", agent="agent-x"))
    record(tmp_path / "one", obs)
    record(tmp_path / "two", obs)
    record(tmp_path / "other", obs, salt=b"another salt, also long")
    one, two, three = (load_trace(tmp_path / n).requests for n in ("one", "two", "other"))
    raw = set(np.concatenate([o.blocks for o in obs]).tolist())
    salted = set(one["block_ids"].explode().to_list())
    assert not raw & salted and len(salted) == len(raw)
    assert one["block_ids"].to_list() == two["block_ids"].to_list()  # same salt, same ids
    assert not salted & set(three["block_ids"].explode().to_list())
    # The files hold no name, header value or URL beyond the engine's, in any form.
    data = b"".join(p.read_bytes() for p in (tmp_path / "one").iterdir())
    for secret in (b"secret", b"sess-", b"agent-x", SALT):
        assert secret not in data
    segment = pl.read_parquet(next((tmp_path / "one").glob(SEGMENT_GLOB)))
    assert set(segment.columns) == {
        "arrival_s", "completion_s", "prompt_tokens", "output_tokens", "cached_tokens",
        "turn", "session", "agent", "parent_agent", "trigger", "engine", "branch",
        "base_row", "shared_blocks", "new_block_ids",
    }  # fmt: skip
    # A follow-up's history is written once, as its base row's blocks (another agent's
    # request is stored whole, though its blocks are the same).
    first, second, other = (len(o.blocks) for o in obs)
    assert segment["new_block_ids"].list.len().sum() == first + (second - first) + other


def test_block_ids_are_salted_with_siphash_2_4() -> None:
    # The reference implementation's vector: key 00..0f, message 00..07.
    message = np.frombuffer(bytes(range(8)), dtype="<i8")
    assert siphash24(bytes(range(16)), message).tobytes().hex() == "6224939a79f5f593"
    ids = np.arange(-5, 5, dtype=np.int64).reshape(2, 5)
    salted = siphash24(bytes(16), ids)
    assert salted.shape == ids.shape and len(set(salted.ravel().tolist())) == 10
    assert (siphash24(bytes(16), ids[1]) == salted[1]).all()


def test_segments_rotate_and_stay_within_the_disk_bound(tmp_path: Path) -> None:
    many = [o for i in range(30) for o in conversation(f"c{i}", i, 3, i * 1.0)]
    rec = record(tmp_path, many, rotate_requests=10)
    files = sorted(tmp_path.glob(SEGMENT_GLOB))
    assert rec.written == 90 and len(files) == 9
    size = files[0].stat().st_size
    bounded = tmp_path / "bounded"
    rec = record(bounded, many, rotate_requests=10, max_bytes=3 * size + size // 2)
    kept = sorted(bounded.glob(SEGMENT_GLOB))
    assert rec.written == 90 and len(kept) == 3
    assert sum(p.stat().st_size for p in kept) <= 3 * size + size // 2
    # The newest segments are the ones kept.
    assert load_trace(bounded).num_requests == 30
    assert not list(bounded.glob(".*.tmp"))


def test_a_writer_that_falls_behind_drops_instead_of_waiting(tmp_path: Path) -> None:
    rec = recorder(tmp_path, max_pending=5)  # not started: nothing drains the queue
    obs = conversation("c", 0, 1, 0.0)[0]
    started = time.perf_counter()
    for _ in range(1000):
        rec.observe(obs)
    assert time.perf_counter() - started < 0.1
    assert rec.dropped == 995
    rec.close()
    assert rec.written == 5
    assert any("dropped 995" in note for note in load_trace(tmp_path).notes)


def test_a_folder_recorded_with_another_salt_is_refused(tmp_path: Path) -> None:
    record(tmp_path, conversation("c", 0, 1, 0.0))
    with pytest.raises(ValueError, match="another salt"):
        Recorder(RecordSettings(tmp_path, block_size=BS))  # a fresh, ephemeral salt
    recorder(tmp_path).close()  # the same salt may go on recording there
    (tmp_path / MANIFEST).unlink()
    assert detect_format(tmp_path) == "weka"  # no manifest: not a recording


def test_a_salt_file_must_be_long_enough(tmp_path: Path) -> None:
    short = tmp_path / "salt"
    short.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        read_salt(short)
    short.write_bytes(SALT)
    assert read_salt(short) == SALT


def test_the_body_says_whether_a_user_or_the_agent_loop_sent_it() -> None:
    tool = {"messages": [{"role": "user", "content": "go"}, {"role": "tool", "content": "ok"}]}
    result = {"role": "user", "content": [{"type": "tool_result", "content": "ok"}]}
    assert body_trigger(tool) == Trigger.AGENT
    assert body_trigger({"messages": [result]}) == Trigger.AGENT
    assert body_trigger({"messages": [{"role": "user", "content": "hi"}]}) == Trigger.USER
    assert body_trigger({"prompt": "x"}) == Trigger.UNKNOWN
    # The Responses API's input: text, a user's message, a tool's output.
    assert body_trigger({"input": "hi"}) == Trigger.USER
    assert body_trigger({"input": [{"role": "user", "content": "hi"}]}) == Trigger.USER
    output = {"type": "function_call_output", "call_id": "c", "output": "ok"}
    assert body_trigger({"input": [output]}) == Trigger.AGENT
    assert body_trigger({"input": [{"type": "reasoning"}]}) == Trigger.UNKNOWN


def test_a_sub_agent_continues_the_request_that_spawned_it(tmp_path: Path) -> None:
    root = conversation("root", 5, 2, 0.0)
    root = [
        RecordedRequest(**{**{f: getattr(o, f) for f in o.__slots__}, "session": "S", "agent": "R"})
        for o in root
    ]
    child = observation(12.0, blocks(list(range(500, 540))), 0, "child", session="S",
                        agent="C", parent_agent="R")  # fmt: skip
    record(tmp_path, [*root, child])
    rows = load_trace(tmp_path).requests
    sub = rows.filter(pl.col("arrival_s") == 12.0).row(0, named=True)
    assert sub["parent_id"] == rows["arrival_s"].to_list().index(10.0)
    assert sub["trigger"] == "agent" and sub["turn"] == 0
    assert rows["session_id"].n_unique() == 1
    assert sorted(set(rows["agent_id"]))[-1] == "main" and rows["agent_id"].n_unique() == 2
