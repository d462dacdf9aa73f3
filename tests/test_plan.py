"""``smetric plan`` on a small case, checked against ``smetric knee`` run by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from smetric.cli import app
from smetric.eval.plan import PlanSettings, _Bisection

# Two minutes of the Mooncake sample's recorded arrivals on H200s: small enough to plan
# in seconds, busy enough that one instance cannot serve it.
CASE = """\
cluster: {hardware: H200}
workload: {trace: sample:mooncake, open_loop: true, duration_s: 30}
policies: [smetric]
"""


def _invoke(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


def _knee(tmp_path: Path, config: Path, instances: int) -> dict:
    out = tmp_path / f"knee-{instances}"
    _invoke(
        "knee", "-c", str(config), "--globals", "none", "--seeds", "1", "--start", "1",
        "--instances", str(instances), "-o", str(out), "-j", "1", "--no-plots",
    )  # fmt: skip
    assert not (out / "knee.png").exists() and (out / "knee.md").exists()
    return json.loads((out / "knee.json").read_text())["cells"][0]["knees"]["smetric"]


def test_plan_agrees_with_knees_found_by_hand(tmp_path: Path) -> None:
    config = tmp_path / "case.yaml"
    config.write_text(CASE)
    out = tmp_path / "plan"
    args = (
        "plan", "-c", str(config), "--globals", "none", "--max-instances", "6",
        "--attainment", "0.9", "--price-per-gpu-hour", "2.5", "-o", str(out), "-j", "1",
    )  # fmt: skip
    _invoke(*args)
    summary = json.loads((out / "plan.json").read_text())
    assert (out / "plan.png").read_bytes()[:4] == b"\x89PNG"
    chosen = summary["plans"]["smetric"]
    n = chosen["instances"]
    assert 1 < n <= 6 and chosen["global"] == "none"
    # The hand check: smetric knee at n and n - 1 instances, from the trace's own load.
    knee = _knee(tmp_path, config, n)
    below = _knee(tmp_path, config, n - 1)
    curve = {p["instances"]: p for p in summary["curves"]["smetric"]["none"]}
    assert knee["load"] >= 1.0
    assert knee["probes"]["1.0"] == pytest.approx(curve[n]["tps_within_slo"])
    assert knee["mean"] == pytest.approx(curve[n]["knee_tps_within_slo"])
    assert knee["load"] == pytest.approx(curve[n]["knee_load"])
    # One fewer instance is past its knee at the trace's load, or misses the attainment.
    assert below["load"] < 1.0 or curve[n - 1]["slo_attainment"] < 0.9
    assert not curve[n - 1]["serves"]
    # The cost: n GPUs an hour over the tokens served within SLO in that hour.
    expected = n * 2.5 / (chosen["tps_within_slo"] * 3600 / 1e6)
    assert chosen["cost_per_million_tokens"] == pytest.approx(expected)
    assert (out / "plan.png").stat().st_size > 0
    # Asked again, nothing is simulated: every probe comes from the run store.
    assert summary["runs_simulated"] > 0
    _invoke(*args)
    assert json.loads((out / "plan.json").read_text())["runs_simulated"] == 0


def test_the_instance_search_doubles_then_bisects() -> None:
    search = _Bisection(least=1, most=64)
    probed = []
    while (n := search.next()) is not None:
        probed.append(n)
        if n >= 11:
            search.serves = n
        else:
            search.fails = n
    assert probed == [1, 2, 4, 8, 16, 12, 10, 11] and search.serves == 11
    capped = _Bisection(least=3, most=5)
    while (n := capped.next()) is not None:
        capped.fails = n
    assert capped.serves is None and capped.fails == 5
    with pytest.raises(ValueError, match="min-instances"):
        PlanSettings(min_instances=4, max_instances=2)


def test_a_config_file_that_says_closed_loop_is_planned_closed_loop(tmp_path: Path) -> None:
    # The Mooncake sample has a clock, so without a word from the user it is replayed at
    # its recorded arrivals; a file saying open_loop: false keeps it closed loop.
    config = tmp_path / "closed.yaml"
    config.write_text(
        "cluster: {hardware: H200}\n"
        "workload: {trace: sample:mooncake, open_loop: false, session_rate: 0.5, "
        "duration_s: 20}\n"
        "policies: [least_load]\n"
    )
    out = tmp_path / "plan"
    _invoke(
        "plan", "-c", str(config), "--globals", "none", "--max-instances", "2",
        "--probes", "2", "-o", str(out), "-j", "1",
    )  # fmt: skip
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["workload"]["open_loop"] is False
    assert written["workload"]["duration_s"] == 20
