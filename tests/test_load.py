from pathlib import Path

import polars as pl
import pytest

from smetric.trace.load import detect_format, load_trace, read_parquet, write_parquet
from smetric.trace.schema import SCHEMA, TraceError

from conftest import real_trace


def test_embedded_samples_load_without_shared_folder() -> None:
    weka = load_trace("sample:weka")
    assert weka.source_format == "weka"
    assert weka.num_sessions == 35
    assert (weka.requests["agent_id"] != "main").any()  # sub-agents are included
    mooncake = load_trace("sample:mooncake")
    assert mooncake.num_requests == 1000
    assert mooncake.sessions_inferred


def test_unknown_sample_and_missing_path_are_clear() -> None:
    with pytest.raises(TraceError, match="unknown sample"):
        load_trace("sample:nope")
    with pytest.raises(TraceError, match="no such file"):
        load_trace("/nonexistent/trace.jsonl")


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("a.jsonl", '{"chat_id": 1, "parent_chat_id": -1}\n', "bailian"),
        ("a.jsonl", '\n{"timestamp": 0, "hash_ids": [1]}\n', "mooncake"),
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "azure"),
        ("a.json", "{}", "weka"),
    ],
)
def test_detect_format(tmp_path: Path, name: str, content: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    assert detect_format(path) == expected


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.txt", "hello", "unknown trace format"),
        ("a.jsonl", '{"foo": 1}\n', "neither Bailian"),
        ("a.jsonl", "not json\n", "not JSON"),
        ("a.jsonl", "\n\n", "empty"),
    ],
)
def test_detect_format_rejects_clearly(tmp_path: Path, name: str, content: str, message: str):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        detect_format(path)


def test_parquet_round_trip_keeps_table_and_metadata(tmp_path: Path) -> None:
    trace = load_trace("sample:mooncake")
    out = tmp_path / "t.parquet"
    write_parquet(trace, out)
    back = load_trace(out)
    assert back.requests.equals(trace.requests)
    assert back.requests.schema == pl.Schema(SCHEMA)
    assert (back.name, back.source_format, back.has_clock, back.sessions_inferred) == (
        trace.name,
        trace.source_format,
        trace.has_clock,
        trace.sessions_inferred,
    )
    assert back.notes == trace.notes


def test_parquet_that_is_not_a_request_table(tmp_path: Path) -> None:
    path = tmp_path / "other.parquet"
    pl.DataFrame({"x": [1]}).write_parquet(path)
    with pytest.raises(TraceError, match="missing columns"):
        read_parquet(path)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(TraceError, match="not a readable Parquet"):
        read_parquet(garbage)


@pytest.mark.parametrize(
    "relative",
    [
        "mooncake/conversation_trace.jsonl",
        "azure-2023/AzureLLMInferenceTrace_conv.csv",
    ],
)
def test_every_shared_trace_loads(relative: str) -> None:
    trace = load_trace(real_trace(relative))
    assert trace.num_requests > 10_000
    assert trace.requests["request_id"].to_list() == list(range(trace.num_requests))


def test_a_trace_path_may_name_an_environment_variable(monkeypatch, tmp_path) -> None:
    from smetric.trace.load import resolve

    (tmp_path / "mooncake").mkdir()
    trace = tmp_path / "mooncake" / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    monkeypatch.setenv("SMETRIC_TRACES", str(tmp_path))
    assert resolve("${SMETRIC_TRACES}/mooncake/t.jsonl") == trace
    monkeypatch.delenv("SMETRIC_TRACES")
    with pytest.raises(TraceError, match="environment variable SMETRIC_TRACES is not set"):
        resolve("$SMETRIC_TRACES/mooncake/t.jsonl")
