import json
from pathlib import Path

import pytest
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


SMALL = ["--instances", "2", "--duration", "60", "--rate", "0.1", "--jobs", "1"]


def test_simulate_writes_results_and_config_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["simulate", "-p", "smetric,least_load", *SMALL, "--global", "1x", "-o", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["policies"]) == ["smetric", "least_load"]
    for policy in ("smetric", "least_load"):
        assert (out / f"requests-{policy}.parquet").exists()
    assert (out / "tps.png").read_bytes()[:4] == b"\x89PNG"
    # The resolved configuration reproduces the run exactly; --no-plots draws nothing.
    again = tmp_path / "again"
    rerun = runner.invoke(
        app,
        [
            "simulate",
            "--config",
            str(out / "config.yaml"),
            "-j",
            "1",
            "-o",
            str(again),
            "--no-plots",
        ],
    )
    assert rerun.exit_code == 0, rerun.output
    assert json.loads((again / "summary.json").read_text()) == summary
    assert not list(again.glob("*.png")) and "0 plots" in rerun.output


def test_yaml_config_equals_flags(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "cluster: {instances: 2, global_capacity: 1x}\n"
        "workload: {duration_s: 60, session_rate: 0.1}\n"
        "policies: [lmetric]\n"
    )
    by_yaml = runner.invoke(
        app, ["simulate", "-c", str(config), "-j", "1", "-o", str(tmp_path / "y")]
    )
    by_flags = runner.invoke(
        app, ["simulate", "-p", "lmetric", *SMALL, "--global", "1x", "-o", str(tmp_path / "f")]
    )
    assert by_yaml.exit_code == 0 and by_flags.exit_code == 0
    assert (tmp_path / "y" / "summary.json").read_text() == (
        tmp_path / "f" / "summary.json"
    ).read_text()


@pytest.mark.subprocess
def test_simulate_bad_options_are_clear(tmp_path: Path) -> None:
    typo = runner.invoke(app, ["simulate", "-p", "smetrik", "-o", str(tmp_path)])
    assert typo.exit_code == 2 and "smetrik" in typo.output and "Traceback" not in typo.output
    glob = runner.invoke(app, ["simulate", "--global", "lots", "-o", str(tmp_path)])
    assert glob.exit_code == 2 and "global capacity" in glob.output
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("cluster: {instancez: 3}\n")
    unknown = runner.invoke(app, ["simulate", "-c", str(bad_yaml), "-o", str(tmp_path)])
    assert unknown.exit_code == 2 and "instancez" in unknown.output
    model = runner.invoke(app, ["simulate", "--model", "gpt-9", "-o", str(tmp_path)])
    assert model.exit_code == 2 and "gpt-9" in model.output


def test_sweep_reports_max_tps_per_provisioning(tmp_path: Path) -> None:
    args = [
        "sweep",
        "-p",
        "smetric,round_robin",
        "--rates",
        "0.05,0.1",
        "--globals",
        "none,full",
        "--instances",
        "2",
        "--duration",
        "60",
        "-j",
        "1",
        "-o",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert len(sweep["runs"]) == 2 * 2 * 2
    for level in ("none", "full"):
        for policy in ("smetric", "round_robin"):
            best = sweep["max_tps"][level][policy]
            runs = [
                r["summary"]["tps_within_slo"]
                for r in sweep["runs"]
                if r["global"] == level and r["policy"] == policy
            ]
            assert best["tps"] == max(runs)
    assert (tmp_path / "max_tps.png").exists()


def test_simulate_disaggregated_by_flags_equals_yaml_and_reports_the_pd_section(
    tmp_path: Path,
) -> None:
    pd = ["--prefill-instances", "2", "--decode-instances", "1", "--decode-policy", "round_robin"]
    by_flags = runner.invoke(app, ["simulate", "-p", "smetric", *SMALL, *pd, "-o", str(tmp_path)])
    assert by_flags.exit_code == 0, by_flags.output
    assert "PD disaggregation" in by_flags.output and "2 prefill + 1 decode" in by_flags.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    pd_section = summary["policies"]["smetric"]["pd"]
    assert (pd_section["mode"], pd_section["decode_policy"]) == ("full", "round_robin")
    config = tmp_path / "c.yaml"
    config.write_text(
        "cluster: {instances: 2, prefill_instances: 2, decode_instances: 1,"
        " decode_policy: round_robin}\n"
        "workload: {duration_s: 60, session_rate: 0.1}\npolicies: [smetric]\n"
    )
    by_yaml = runner.invoke(
        app, ["simulate", "-c", str(config), "-j", "1", "-o", str(tmp_path / "y")]
    )
    assert by_yaml.exit_code == 0, by_yaml.output
    assert json.loads((tmp_path / "y" / "summary.json").read_text()) == summary
    only = ["simulate", "-p", "smetric", *SMALL, *pd[:2], "-o", str(tmp_path / "only")]
    prefill_only = runner.invoke(app, only)  # the paper's prefill-only evaluation
    assert prefill_only.exit_code == 0, prefill_only.output
    only_summary = json.loads((tmp_path / "only" / "summary.json").read_text())
    assert only_summary["policies"]["smetric"]["pd"]["mode"] == "prefill-only"
    assert (tmp_path / "only" / "latency.png").exists()
    lonely = runner.invoke(app, ["simulate", "--decode-instances", "2", "-o", str(tmp_path)])
    assert lonely.exit_code == 2 and "need prefill instances" in lonely.output
    rule = runner.invoke(app, ["simulate", *pd[:4], "--decode-policy", "x", "-o", str(tmp_path)])
    assert rule.exit_code == 2 and "--decode-policy 'x': use one of" in rule.output


def test_knee_finds_each_policys_peak_and_names_the_best_baseline(tmp_path: Path) -> None:
    args = [
        "knee",
        "-p",
        "smetric_cost,least_load,linear:lam=0.5",
        "--globals",
        "full",
        "--kv-loads",
        "sync,async",
        "--instances",
        "2",
        "--duration",
        "120",
        "--warmup",
        "20",
        "--seeds",
        "2",
        "--start",
        "0.05",
        "--precision",
        "1.5",
        "-j",
        "1",
        "-o",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Max TPS within SLO" in result.output
    summary = json.loads((tmp_path / "knee.json").read_text())
    assert [(c["global"], c["kv_load"]) for c in summary["cells"]] == [
        ("full", "sync"),
        ("full", "async"),
    ]
    for cell in summary["cells"]:
        assert cell["best_baseline"] in ("least_load", "linear:lam=0.5")
        for knee in cell["knees"].values():
            probes = {float(load): tps for load, tps in knee["probes"].items()}
            # The knee is the best probe, and the probes bracket it unless it is at an end.
            assert knee["mean"] == max(probes.values())
            assert len(knee["seeds"]) == 2
    assert (tmp_path / "knee.png").stat().st_size > 0
    assert "vs best baseline" in (tmp_path / "knee.md").read_text()


# A run this short ends within its warm-up: its figures must say so, not warn.
@pytest.mark.filterwarnings("error")
def test_rescoring_a_run_under_its_own_slo_gives_its_numbers(tmp_path: Path) -> None:
    import importlib.util

    from smetric.metrics.slo import SLOConfig

    path = Path(__file__).resolve().parents[1] / "scripts" / "rescore_slo.py"
    spec = importlib.util.spec_from_file_location("rescore_slo", path)
    assert spec is not None and spec.loader is not None
    rescore_slo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rescore_slo)
    out = tmp_path / "run"
    args = ["simulate", "-p", "smetric,least_load", *SMALL, "--warmup", "10", "-o", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    summary = json.loads((out / "summary.json").read_text())["policies"]
    scores = rescore_slo.rescore(out, SLOConfig(ttft_base_s=1e6, ttft_per_token_s=0.0, tpot_s=1e6))
    for policy, (own, loose) in scores.items():
        assert own == summary[policy]["tps_within_slo"]
        # Under an SLO nothing misses, TPS within SLO is the run's whole TPS.
        assert loose == pytest.approx(summary[policy]["tps"])


def test_simulate_reports_the_hardware_constants_smetric_cost_assumed(tmp_path: Path) -> None:
    policies = "smetric_cost,smetric_cost:prefill_tps=9000,least_load"
    args = ["simulate", "-p", policies, *SMALL, "--hardware", "H200", "--kv-dtype", "fp8"]
    result = runner.invoke(app, [*args, "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    params = json.loads((tmp_path / "summary.json").read_text())["policy_params"]
    assert params["smetric_cost"]["fetch_tps"] == 220_000.0
    assert params["smetric_cost:prefill_tps=9000"]["prefill_tps"] == 9000.0
    assert params["least_load"] == {}
    assert "smetric_cost assumed prefill_tps=" in " ".join(result.output.split())
