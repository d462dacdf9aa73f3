"""``smetric reproduce`` on a tiny preset: every figure and table, the same numbers twice,
a second run that simulates nothing, clear errors, and the stamped results page."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from markupsafe import escape
from typer.testing import CliRunner

from smetric.cli import app
from smetric.eval.paper import comparisons
from smetric.eval.preset import load_preset

from conftest import tiny_sim_yaml

runner = CliRunner()

TINY = (
    tiny_sim_yaml(0)
    + """\
seeds: 1
precision: 2.0
load_multiples: [1.0, 1.5, 2.0]
overloads: [1.0, 2.0, .inf]
hit_ratios: [0.0, 0.5]
ceiling: true
"""
)
POLICIES = "smetric,least_load,linear"
FIGURES = (
    "max_tps",
    "knee",
    "reuse_by_provisioning",
    "tps_vs_rate",
    "latency",
    "heatmaps",
    "stickiness",
    "guard",
    "sensitivity",
)
TITLES = (
    "The paper's numbers beside ours",
    "Max TPS within SLO per global tier (Figs. 11a, 16a)",
    "Where prompt tokens came from at each knee (Figs. 11b, 16b)",
    "TPS within SLO vs offered load, full global tier (Fig. 15a)",
    "Figs. 12, 15b, 17",
    "SMetric's overload guard on and off (Fig. 14)",
    "Sensitivity to OVERLOAD and HIT_RATIO (Fig. 25)",
)


def reproduce(preset: Path, out: Path, *extra: str) -> str:
    args = ["reproduce", "--preset", str(preset), "-p", POLICIES, "-j", "1", "-o", str(out)]
    result = runner.invoke(app, [*args, *extra])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    folder = tmp_path_factory.mktemp("reproduce")
    preset = folder / "tiny.yaml"
    preset.write_text(TINY)
    out = folder / "first"
    return preset, out, reproduce(preset, out)


def test_the_report_has_every_figure_and_table(tiny: tuple[Path, Path, str]) -> None:
    _, out, output = tiny
    assert "simulated" in output and "(every run reused" not in output
    html = (out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == len(FIGURES)
    for name in FIGURES:
        assert (out / f"{name}.png").exists() or (out / "paper-load" / f"{name}.png").exists()
    markdown = (out / "validation.md").read_text()
    for title in TITLES:
        assert title in markdown and str(escape(title)) in html
    result = json.loads((out / "reproduce.json").read_text())
    assert list(result["tiers"]) == ["none", "full"]
    assert result["policies"] == POLICIES.split(",")
    # The ceiling: every policy's knee with a free global tier, the best of them.
    ceiling = result["ceiling"]
    assert set(ceiling["knees"]) == set(result["policies"])
    top = ceiling["knees"][ceiling["best"]]["mean"]
    assert top == max(k["mean"] for k in ceiling["knees"].values())
    none = result["tiers"]["none"]["policies"]
    assert top >= max(v["knee"]["mean"] for v in none.values())
    assert f"| ceiling: free global tier, best of all ({ceiling['best']}) |" in markdown
    # 1.5x load is the best baseline's searched knee on the full tier, by definition.
    unit = result["load_unit"]
    assert unit["reference_policy"] in ("least_load", "linear")
    assert result["at_paper_load"]["rate"] == unit["reference_knee"]
    # Every published number the paper gives for colocation gets a row, none left blank.
    rows = comparisons(result)
    assert {row.figure for row in rows} >= {
        "11a",
        "11b",
        "12",
        "14",
        "15a",
        "15b",
        "16a",
        "16b",
        "17",
        "25",
    }
    for row in rows:
        assert row.ours and row.ours != "-", row
        assert f"| {row.figure} | {row.claim} |" in markdown


def test_the_max_tps_is_the_max_over_every_rate_run(tiny: tuple[Path, Path, str]) -> None:
    _, out, _ = tiny
    result = json.loads((out / "reproduce.json").read_text())
    full = result["tiers"]["full"]
    sweep = result["rate_sweep"]
    for p, points in sweep["policies"].items():
        knee = full["policies"][p]["knee"]
        assert knee["mean"] >= max(point["tps_within_slo"] for point in points)
        assert knee["mean"] == max(knee["probes"].values())
        for rate, point in zip(sweep["rates"], points, strict=True):
            assert knee["probes"][str(rate)] == point["tps_within_slo"]
    means = {p: v["knee"]["mean"] for p, v in full["policies"].items()}
    baselines = {p: m for p, m in means.items() if not p.startswith("smetric")}
    assert full["best_baseline"] == max(baselines, key=lambda p: baselines[p])


def test_every_figure_and_table_counts_the_windows_after_the_warm_up(
    tiny: tuple[Path, Path, str],
) -> None:
    _, out, _ = tiny
    result = json.loads((out / "reproduce.json").read_text())
    paths = sorted((out / "runs").glob("*/summary.json"))
    assert paths
    for summary in (json.loads(path.read_text()) for path in paths):
        first = math.ceil(summary["warmup_s"] / summary["window_s"])
        heat = summary["load_heatmap"]
        counted = [
            max(col) / (sum(col) / len(col))
            for col in zip(*(row[first:] for row in heat), strict=True)
            if sum(col) > 0
        ]
        assert summary["imbalance"]["series"] == pytest.approx(counted)
        # The heatmaps' titles and the tables both read this mean.
        assert summary["imbalance"]["mean"] == pytest.approx(sum(counted) / len(counted))
    assert "after the warm-up" in (out / "validation.md").read_text()
    assert result["at_paper_load"]["policies"]


def test_a_second_run_simulates_nothing_and_gives_the_same_report(
    tiny: tuple[Path, Path, str],
) -> None:
    preset, out, _ = tiny
    before = (out / "reproduce.json").read_text(), (out / "validation.md").read_text()
    runs = sorted(p.name for p in (out / "runs").iterdir())
    output = reproduce(preset, out)
    assert "simulated 0 runs (every run reused from runs/)" in output
    assert sorted(p.name for p in (out / "runs").iterdir()) == runs
    assert ((out / "reproduce.json").read_text(), (out / "validation.md").read_text()) == before


def test_the_same_inputs_from_scratch_give_the_same_numbers(
    tiny: tuple[Path, Path, str], tmp_path: Path
) -> None:
    preset, out, _ = tiny
    again = tmp_path / "again"
    output = reproduce(preset, again)
    assert "simulated 0 runs" not in output
    for name in ("reproduce.json", "validation.md"):
        assert (again / name).read_text() == (out / name).read_text()


@pytest.mark.subprocess
def test_page_option_writes_validation_as_a_stamped_results_page(
    tiny: tuple[Path, Path, str], tmp_path: Path
) -> None:
    preset, out, _ = tiny
    page = tmp_path / "reproduce.md"
    work = tmp_path / "out"
    shutil.copytree(out / "runs", work / "runs")
    output = reproduce(preset, work, "--page", str(page))
    assert "simulated 0 runs" in output
    validation = (work / "validation.md").read_text()
    text = page.read_text()
    assert text.startswith("# The paper's colocation evaluation\n")
    assert f"**Command:** `smetric reproduce --preset {preset}" in text
    assert "**Machine:** " in text and "**Date:** " in text
    assert text.endswith(validation.strip() + "\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "medium"], "use quick or full or large"),
        (["-p", "smetrik"], "smetrik"),
        (["sample:nothing"], "sample"),
        (["--page", "missing/reproduce.md"], "missing"),
    ],
)
def test_bad_input_is_a_clear_error_before_any_run(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["reproduce", *args, "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_a_bad_preset_file_names_the_key(tmp_path: Path) -> None:
    preset = tmp_path / "bad.yaml"
    preset.write_text(TINY.replace("tiers: {none: 0.02, full: 0.04}", "tiers: {none: 0.02}"))
    result = runner.invoke(app, ["reproduce", "--preset", str(preset), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "include 'full'" in result.output
    assert not (tmp_path / "o").exists()


def test_a_reproduce_variant_extends_a_shipped_preset(tmp_path: Path) -> None:
    preset = tmp_path / "quick-3.yaml"
    preset.write_text("extends: quick\nseeds: 3\nconfig: {cluster: {instances: 8}}\n")
    quick, variant = load_preset("quick"), load_preset(str(preset))
    assert (variant.name, variant.seeds, variant.config.cluster.instances) == ("quick-3", 3, 8)
    assert variant.config.workload == quick.config.workload
    assert variant.config.cluster.hardware == quick.config.cluster.hardware
    assert (variant.tiers, variant.load_multiples) == (quick.tiers, quick.load_multiples)
