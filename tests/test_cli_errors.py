"""A command ends as bad input (one line, exit 2) or as a bug (said so, exit 1), never mixed."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from smetric.cli import app
from smetric.trace import weka

runner = CliRunner()


def broken_loader(path: Path, progress: object = None) -> None:
    # What a bug deep in a run looks like: numpy and polars raise plain ValueErrors.
    raise ValueError("operands could not be broadcast together with shapes (3,) (4,)")


def test_an_internal_value_error_is_reported_as_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weka, "load", broken_loader)
    result = runner.invoke(app, ["trace", "info", "sample:weka"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[0] == (
        "internal error: ValueError: operands could not be broadcast together with shapes (3,) (4,)"
    )
    assert lines[1] == "this is a bug in SMetric; rerun with --debug for the traceback"
    assert "Traceback" not in result.output


def test_debug_lets_the_traceback_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weka, "load", broken_loader)
    result = runner.invoke(app, ["--debug", "trace", "info", "sample:weka"])
    assert result.exit_code == 1
    assert isinstance(result.exception, ValueError)
    assert "internal error" not in result.output


def test_bad_input_is_still_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = runner.invoke(app, ["trace", "info", str(missing)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: {missing}: no such file or folder"]


def test_a_bad_setting_is_bad_input(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--policies", "nonsense", "-o", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown policy 'nonsense'" in result.output
    assert "internal error" not in result.output


def test_a_result_of_another_schema_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"policies": {"smetric": {"tps": 1}}}))
    result = runner.invoke(app, ["report", str(tmp_path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"error: {tmp_path / 'summary.json'}: not a RunSummary")


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (
            ["serve", "-e", "http://127.0.0.1:1", "-e", "http://127.0.0.1:1/"],
            "error: engine http://127.0.0.1:1 is listed twice",
        ),
        (
            ["pick", "-e", "http://localhost:8000"],
            "error: engine 'http://localhost:8000': the picker names engines by IP address",
        ),
        (
            ["simulate", "--global", "nanx", "-p", "least_load"],
            "error: global capacity 'nanx': use none, full, or a ratio",
        ),
    ],
    ids=["serve", "pick", "simulate"],
)
def test_bad_configuration_is_one_line_per_command(
    command: list[str], message: str, tmp_path: Path
) -> None:
    # Each is a ConfigError where the setting is checked: no blanket ValueError catch
    # around the command, which would pass a bug off as the user's mistake.
    if command[0] == "pick":
        pytest.importorskip("grpc")
    where = ["-o", str(tmp_path)] if command[0] == "simulate" else ["--port", "0"]
    result = runner.invoke(app, [*command, *where])
    assert result.exit_code == 2
    [line] = result.output.strip().splitlines()
    assert line.startswith(message)


def test_a_bound_kv_event_endpoint_with_several_workers_is_refused_before_serving(
    tmp_path: Path,
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "engines:\n"
        "  - url: http://127.0.0.1:1\n"
        "    kv_events: {endpoint: 'tcp://127.0.0.1:1', bind: true}\n"
    )
    result = runner.invoke(app, ["serve", "-c", str(config), "--workers", "2", "--port", "0"])
    assert result.exit_code == 2
    # Refused before the banner: nothing claims to serve.
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: with several workers, KV-event subscribers cannot bind")
    # Nor did it leave this process's metrics shared between workers that never came.
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
