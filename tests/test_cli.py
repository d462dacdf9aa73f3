import json
from pathlib import Path

from typer.testing import CliRunner

from smetric.cli import app

runner = CliRunner()


def test_analyze_default_sample_writes_every_output(tmp_path: Path) -> None:
    result = runner.invoke(app, ["analyze", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert data["trace"]["name"] == "weka-claude-code"
    assert 0.9 < data["reuse"]["ratio"] < 1.0
    for name in ("reuse", "reuse_intervals", "triggers", "session_usage", "balance"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 5
    assert f"{data['reuse']['ratio']:.1%}" in result.output


def test_analyze_mooncake_sample_and_options(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["analyze", "sample:mooncake", "-o", str(tmp_path), "--instances", "4"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "analysis.json").read_text())
    assert data["balance"]["instances"] == 4
    assert data["balance"]["arrivals"] == "recorded"
    assert data["trace"]["sessions_inferred"] is True


def test_trace_info_and_convert_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "sample.parquet"
    converted = runner.invoke(app, ["trace", "convert", "sample:mooncake", str(out)])
    assert converted.exit_code == 0, converted.output
    info = runner.invoke(app, ["trace", "info", str(out)])
    assert info.exit_code == 0, info.output
    assert "1,000" in info.output
    assert "(inferred)" in info.output


def test_bad_input_is_one_located_line_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": "ten", "output_length": 1, "hash_ids": [1]}\n'
    )
    result = runner.invoke(app, ["analyze", str(bad), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert f"{bad}:2" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_non_parquet_target(tmp_path: Path) -> None:
    result = runner.invoke(app, ["trace", "convert", "sample:mooncake", str(tmp_path / "x.csv")])
    assert result.exit_code == 2
    assert "must be a .parquet file" in result.output
