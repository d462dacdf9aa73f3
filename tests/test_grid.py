"""``smetric grid``: the verdict as a pure function of knees, a tiny grid end to end, a
policy added later running only its own probes, and clear errors for bad presets."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from smetric.cli import app
from smetric.eval.grid import cell_verdict, grid_cells, means_of, twin_of, verdict_summary
from smetric.eval.grid_preset import load_grid_preset
from smetric.metrics.slo import SLOConfig
from smetric.metrics.summary import tps_under_slo
from smetric.report.grid import (
    grid_markdown,
    grid_table,
    headroom_line,
    robustness_table,
    verdict_line,
)
from smetric.sim.knee import probe_job
from smetric.sim.parallel import RunStore

from conftest import tiny_sim_yaml

runner = CliRunner()

TINY = (
    "traces:\n  weka:\n"
    + tiny_sim_yaml(4)
    + """\
kv_loads: [sync]
hardware:
  H20-bf16: {hardware: H20, kv_dtype: bf16}
seeds: 1
grow: 2.0
precision: 2.0
loose_slo: {ttft_base_s: 2.0, ttft_per_token_s: 0.0005, tpot_s: 0.03}
"""
)


def test_cell_verdict_compares_each_of_ours_with_the_best_baseline_at_its_best_setting() -> None:
    means = {
        "smetric": 95.0,
        "smetric_cost": 106.0,
        "least_load": 90.0,
        "linear:lam=0.3": 100.0,
        "linear:lam=0.9": 60.0,
    }
    verdict = cell_verdict(means)
    assert verdict["best_baseline"] == "linear:lam=0.3"
    assert verdict["value"] == 100.0
    assert verdict["lead"] == pytest.approx({"smetric": -5.0, "smetric_cost": 6.0})


def test_verdict_counts_cells_within_one_percent_and_five_percent_ahead() -> None:
    cells = [
        {"smetric_cost": 99.0, "least_load": 100.0},  # -1 %: within
        {"smetric_cost": 98.9, "least_load": 100.0},  # -1.1 %: not within
        {"smetric_cost": 105.0, "cache_aware": 100.0},  # +5 %: within and ahead
        {"smetric_cost": 104.9, "cache_aware": 100.0},  # +4.9 %: within only
        {"smetric_cost": 50.0, "least_load": 0.0},  # nothing to compare with
    ]
    summary = verdict_summary(cells)
    assert summary == {"smetric_cost": {"cells": 4, "within_1pct": 3, "ahead_5pct": 1}}
    assert verdict_line(cells) == (
        "Verdict: `smetric_cost` within 1 % of the best baseline (or ahead) in 3 of 4 cells, "
        "at least 5 % ahead in 1."
    )


def test_grid_table_has_a_row_per_cell_with_the_best_baseline_and_our_lead() -> None:
    def knee(mean: float, load: float) -> dict:
        return {"mean": mean, "stdev": 2000.0, "load": load, "seeds": [mean - 2e3, mean + 2e3]}

    result = {
        "policies": ["smetric", "least_load", "cache_aware"],
        "cells": [
            {
                "trace": "weka",
                "tier": "1x",
                "kv_load": "async",
                "hardware": "H200-fp8",
                "knees": {
                    "smetric": knee(110e3, 0.3),
                    "least_load": knee(100e3, 0.3),
                    "cache_aware": knee(80e3, 0.2),
                },
            }
        ],
    }
    table = grid_table(result).splitlines()
    assert table[0] == "| cell | best baseline | smetric |"
    assert table[2] == (
        "| weka · 1x · async · H200-fp8 | least_load 100.0k ± 2.0k (@0.3) "
        "| 110.0k ± 2.0k (@0.3), +10.0 % |"
    )


def test_headroom_counts_wins_only_where_the_ceiling_leaves_room_for_one() -> None:
    def cell(tier: str, hardware: str, **means: float) -> dict:
        knees = {p: {"mean": m} for p, m in means.items()}
        return {"trace": "t", "tier": tier, "kv_load": "sync", "hardware": hardware,
                "knees": knees}  # fmt: skip

    cells = [
        cell("free", "A", smetric_cost=120.0, least_load=118.0),  # ceiling 120
        cell("1x", "A", smetric_cost=110.0, least_load=100.0),  # room; a win
        cell("full", "A", smetric_cost=112.0, least_load=110.0),  # room; no win
        cell("free", "B", smetric_cost=103.0, least_load=104.0),  # ceiling 104
        cell("1x", "B", smetric_cost=101.0, least_load=100.0),  # 4 % above: no room
    ]
    result = {"policies": ["smetric_cost", "least_load"], "cells": cells}
    line = headroom_line(result)
    assert line is not None
    assert line.startswith("Headroom: in 2 of 3 cells the free-tier ceiling is at least 5 %")
    assert "at least 5 % ahead in those: `smetric_cost` in 1." in line
    no_ceiling = {**result, "cells": [c for c in cells if c["tier"] != "free"]}
    assert headroom_line(no_ceiling) is None


def test_cells_cover_the_product_and_scale_first_loads_by_hardware(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        TINY.replace("kv_loads: [sync]", "kv_loads: [sync, async]")
        .replace(
            "  H20-bf16: {hardware: H20, kv_dtype: bf16}",
            "  H20-bf16: {hardware: H20, kv_dtype: bf16}\n"
            "  H200-fp8: {hardware: H200, kv_dtype: fp8}",
        )
        .replace("    tiers:", "    scale: {H200-fp8: 3}\n    tiers:")
    )
    cells = grid_cells(load_grid_preset(str(path)))
    assert len(cells) == 2 * 2 * 2
    assert cells["weka", "full", "async", "H20-bf16", "configured"][1] == 0.04
    config, start = cells["weka", "full", "async", "H200-fp8", "configured"]
    assert (config.cluster.hardware, config.cluster.kv_dtype) == ("H200", "fp8")
    assert (config.cluster.kv_load, config.cluster.global_capacity) == ("async", "full")
    assert start == pytest.approx(0.12)
    assert load_grid_preset("grid-quick").name == "grid-quick"


@pytest.mark.parametrize(
    ("small", "large"), [("grid-quick", "grid-16"), ("robustness", "robustness-32")]
)
def test_the_larger_preset_is_the_smaller_on_twice_the_instances_at_twice_the_loads(
    monkeypatch: pytest.MonkeyPatch, small: str, large: str
) -> None:
    monkeypatch.setenv("SMETRIC_TRACES", "/traces")
    base, grown = load_grid_preset(small), load_grid_preset(large)
    assert grown.traces.keys() == base.traces.keys()
    for name, trace in grown.traces.items():
        assert trace.config.cluster.instances == 2 * base.traces[name].config.cluster.instances
        assert trace.tiers == pytest.approx({t: 2 * v for t, v in base.traces[name].tiers.items()})
        assert trace.config.workload == base.traces[name].config.workload
        assert trace.scale == base.traces[name].scale
    same = ("kv_loads", "hardware", "seeds", "grow", "precision", "loose_slo", "worlds", "ceiling")
    assert all(getattr(grown, f) == getattr(base, f) for f in same)


def test_a_variant_extends_a_shipped_preset_stating_only_what_it_changes(
    tmp_path: Path,
) -> None:
    variant = tmp_path / "held-out.yaml"
    variant.write_text(
        "extends: robustness\n"
        "traces: {weka: {config: {workload: {trace: /data/weka}}, tiers: {1x: null}}}\n"
        "seeds: 1\n"
    )
    base, held_out = load_grid_preset("robustness"), load_grid_preset(str(variant))
    assert held_out.name == "held-out"
    assert held_out.seeds == 1
    assert held_out.worlds == base.worlds
    weka, base_weka = held_out.traces["weka"], base.traces["weka"]
    assert weka.config.workload.trace == "/data/weka"
    assert weka.config.workload.duration_s == base_weka.config.workload.duration_s
    assert weka.config.cluster == base_weka.config.cluster
    assert weka.tiers == {t: v for t, v in base_weka.tiers.items() if t != "1x"}


def test_a_variant_extends_a_file_beside_it(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(TINY)
    (tmp_path / "sub").mkdir()
    variant = tmp_path / "sub" / "v.yaml"
    variant.write_text("extends: ../base.yaml\nseeds: 2\n")
    assert load_grid_preset(str(variant)).seeds == 2
    assert (
        load_grid_preset(str(variant)).traces
        == load_grid_preset(str(tmp_path / "base.yaml")).traces
    )


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"a.yaml": "extends: a.yaml\n"}, "loops back"),
        ({"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: a.yaml\n"}, "loops back"),
        ({"a.yaml": "extends: 3\n"}, "extends must name a preset"),
        ({"a.yaml": "extends: missing.yaml\n"}, "no such preset"),
        ({"a.yaml": "extends: b.yaml\n", "b.yaml": "[1, 2]\n"}, "top level is not a mapping"),
    ],
)
def test_a_bad_extends_is_a_clear_error(
    tmp_path: Path, files: dict[str, str], message: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    path = tmp_path / "a.yaml"
    result = runner.invoke(app, ["grid", "--preset", str(path), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def grid(preset: Path, out: Path, policies: str, *extra: str) -> str:
    args = ["grid", "--preset", str(preset), "-p", policies, "-j", "1", "-o", str(out)]
    result = runner.invoke(app, [*args, *extra])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.subprocess
def test_tiny_grid_and_a_policy_added_later_runs_only_its_probes(tmp_path: Path) -> None:
    preset, out = tmp_path / "tiny.yaml", tmp_path / "out"
    preset.write_text(TINY)
    page = tmp_path / "grid.md"
    grid(preset, out, "smetric,least_load", "--page", str(page))
    first = json.loads((out / "grid.json").read_text())
    stored = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    probes = sum(len(c["knees"][p]["probes"]) for c in first["cells"] for p in first["policies"])
    assert len(stored) == probes
    text = page.read_text()
    assert text.startswith("# The policy grid\n")
    assert "**Command:** `smetric grid --preset" in text and "**Commit:** " in text
    assert (out / "grid.md").read_text().strip() in text
    assert "| weka · none · sync · H20-bf16 | least_load" in text

    output = grid(preset, out, "smetric,least_load,cache_aware")
    second = json.loads((out / "grid.json").read_text())
    added = sum(len(c["knees"]["cache_aware"]["probes"]) for c in second["cells"])
    assert f"simulated {added} runs" in output
    after = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    assert len(after) == probes + added
    assert all(after[p] == t for p, t in stored.items())  # the others' runs untouched
    for old, new in zip(first["cells"], second["cells"], strict=True):
        for p in first["policies"]:
            assert new["knees"][p] == old["knees"][p]
            # A looser SLO admits every request the default one does, and maybe more.
            assert new["loose"][p]["mean"] >= new["knees"][p]["mean"]


def test_rescoring_under_the_run_own_slo_gives_its_stored_value(tmp_path: Path) -> None:
    preset, out = tmp_path / "tiny.yaml", tmp_path / "out"
    preset.write_text(TINY)
    grid(preset, out, "least_load")
    store = RunStore(out / "runs")
    cells = grid_cells(load_grid_preset(str(preset)))
    config, _ = cells["weka", "full", "sync", "H20-bf16", "configured"]
    result = json.loads((out / "grid.json").read_text())
    load = result["cells"][1]["knees"]["least_load"]["load"]
    job = probe_job(("x",), dataclasses.replace(config, policies=("least_load",)), load, 0)
    summary = store.get(job, with_requests=True)
    assert summary is not None
    table = store.requests(job)
    assert tps_under_slo(table, summary, SLOConfig(), 2) == summary["tps_within_slo"]
    assert tps_under_slo(table, summary, SLOConfig(0.01, 0.0, 0.001), 2) < summary["tps_within_slo"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("seeds: 1", "seeds: 0"), "seeds: expected a positive number"),
        (("kv_loads: [sync]", "kv_loads: [lazy]"), "kv_load 'lazy'"),
        (("tiers: {none: 0.02, full: 0.04}", "tiers: {2y: 0.02}"), "2y"),
        (("precision: 2.0\n", ""), "precision is required"),
        (("kv_dtype: bf16}", "kv_dtype: bf16, scale: 1}"), "hardware.H20-bf16"),
        (("    tiers:", "    scale: {H100: 2}\n    tiers:"), "['H100'] not among hardware"),
        (("    tiers:", "    scale: {H20-bf16: 0}\n    tiers:"), "scale.H20-bf16"),
        (("loose_slo: {", "loose_slo: {ttft: 1, "), "loose_slo"),
        (("traces:", "trace:"), "unknown key 'trace'; the top level takes traces"),
        (("seeds: 1", "worlds: {slow: {prefill: 2}}\nseeds: 1"), "worlds.slow: unknown pert"),
        (("seeds: 1", "worlds: {slow: {kv_room_scale: -1}}\nseeds: 1"), "kv_room_scale: expec"),
        (("seeds: 1", "ceiling: 1\nseeds: 1"), "ceiling: expected true or false"),
        (("seeds: 1", "tier_ceilings: both\nseeds: 1"), "tier_ceilings: expected true or false"),
        (("seeds: 1", "title: ''\nseeds: 1"), "title: expected a non-empty heading"),
    ],
)
def test_bad_preset_is_a_clear_error(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(TINY.replace(*change))
    result = runner.invoke(app, ["grid", "--preset", str(path), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.subprocess
def test_a_results_page_is_headed_by_the_preset_title_else_by_what_it_measures(
    tmp_path: Path,
) -> None:
    variant = tmp_path / "held-out-32.yaml"
    variant.write_text("extends: robustness-32\nseeds: 1\n")
    titles = {
        spec: load_grid_preset(spec).page_title
        for spec in ("grid-quick", "grid-16", "robustness", "robustness-32", str(variant))
    }
    assert titles["grid-quick"] == "The policy grid"
    assert titles["robustness"].startswith("Robustness: ")
    assert titles["grid-16"] == "The policy grid on 16 instances"
    assert titles[str(variant)] == titles["robustness-32"] == "Robustness on 32 instances"
    preset, out, page = tmp_path / "tiny.yaml", tmp_path / "out", tmp_path / "page.md"
    preset.write_text("title: A tiny grid\n" + TINY)
    grid(preset, out, "least_load", "--page", str(page))
    assert page.read_text().startswith("# A tiny grid\n")


def test_unknown_preset_name_is_a_clear_error() -> None:
    result = runner.invoke(app, ["grid", "--preset", "grid-huge"])
    assert result.exit_code == 2
    assert "grid-quick" in result.output


def test_worlds_and_ceiling_cells_perturb_only_the_engines(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        TINY.replace(
            "seeds: 1",
            "worlds: {configured: {}, slow: {prefill_slowdown: 1.5}}\nceiling: true\nseeds: 1",
        )
    )
    cells = grid_cells(load_grid_preset(str(path)))
    # (none, full, free) x (configured, slow)
    assert len(cells) == 3 * 2
    slow, _ = cells["weka", "none", "sync", "H20-bf16", "slow"]
    assert slow.cluster.prefill_slowdown == 1.5
    assert slow.cluster.global_capacity == "none"
    free, start = cells["weka", "free", "sync", "H20-bf16", "slow"]
    assert free.cluster.prefill_slowdown == 1.5
    assert free.cluster.global_capacity == "full"
    assert free.cluster.tier_bandwidth_scale == math.inf
    assert start == 0.04  # the highest tier's first load


def test_tier_ceilings_add_each_bounded_tiers_free_twin(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        TINY.replace("{none: 0.02, full: 0.04}", "{none: 0.02, 1x: 0.03, full: 0.04}").replace(
            "seeds: 1", "worlds: {configured: {}, slow: {tier_bandwidth_scale: 0.5}}\nseeds: 1"
        )
        + "ceiling: true\ntier_ceilings: true\n"
    )
    cells = grid_cells(load_grid_preset(str(path)))
    # (none, 1x, full, free, free-1x) x two worlds: no twin for none (nothing moves) or
    # full (its twin is the free tier)
    assert {key[1] for key in cells} == {"none", "1x", "full", "free", "free-1x"}
    assert len(cells) == 5 * 2
    twin, start = cells["weka", "free-1x", "sync", "H20-bf16", "slow"]
    assert twin.cluster.global_capacity == "1x"  # the tier's own capacity
    assert twin.cluster.tier_bandwidth_scale == math.inf  # the world's wire made free
    assert twin.cluster.global_medium == "line-rate"
    assert start == 0.03  # the tier's own first load
    measured, _ = cells["weka", "1x", "sync", "H20-bf16", "slow"]
    assert measured.cluster.tier_bandwidth_scale == 0.5
    assert [twin_of(t) for t in ("none", "1x", "full")] == [None, "free-1x", "free"]


def test_own_tier_ceiling_is_counted_per_tier_and_full_takes_the_free_tier() -> None:
    def cell(tier: str, **means: float) -> dict:
        knees = {p: {"mean": m, "stdev": 0.0, "load": 0.1, "seeds": [m]} for p, m in means.items()}
        return {"trace": "t", "tier": tier, "kv_load": "sync", "hardware": "A", "knees": knees}

    cells = [
        cell("free", smetric_cost=200e3, least_load=190e3),  # the unbounded ceiling
        cell("free-1x", smetric_cost=104e3, least_load=103e3),  # 1x's own: 4 % of room
        cell("none", smetric_cost=80e3, least_load=82e3),  # no tier: no own ceiling
        cell("1x", smetric_cost=101e3, least_load=100e3),
        cell("full", smetric_cost=170e3, least_load=150e3),  # room under free; a win
    ]
    result = {"policies": ["smetric_cost", "least_load"], "cells": cells}
    line = headroom_line(result)
    assert line is not None
    # The unbounded ceiling leaves room everywhere; the own-tier one only above full.
    assert line.startswith("Headroom: in 3 of 3 cells the free-tier ceiling")
    assert "with a global tier leave room" in line
    assert "), 1 of the 2 cells with a global tier leave room for a lead of 5 %" in line
    assert line.endswith("at least 5 % ahead in those: `smetric_cost` in 1.")
    rows = grid_table(result).splitlines()
    assert rows[0].endswith("| ceiling: own tier, free | ceiling (best of all) |")
    assert rows[2].endswith("| - | 200.0k, best 41% |")  # none: no own ceiling
    assert rows[3].endswith("| 104.0k, best 97% | 200.0k, best 50% |")  # 1x: 101 of 104
    assert rows[4].endswith("| 200.0k, best 85% | 200.0k, best 85% |")  # full: the free tier
    unbounded_only = {**result, "cells": [c for c in cells if c["tier"] != "free-1x"]}
    assert "own tier" not in grid_table(unbounded_only)
    assert "own tier" not in (headroom_line(unbounded_only) or "")


def test_robustness_table_gives_the_default_policy_lead_per_world_over_seeds() -> None:
    def knee(seeds: list[float]) -> dict:
        mean = sum(seeds) / len(seeds)
        return {"mean": mean, "stdev": 0.0, "load": 0.1, "seeds": seeds}

    def cell(tier: str, world: str, ours: list[float], rival: list[float]) -> dict:
        knees = {"smetric_cost": knee(ours), "least_load": knee(rival)}
        return {
            "trace": "weka", "tier": tier, "kv_load": "sync", "hardware": "H20",
            "world": world, "knees": knees, "loose": knees,
        }  # fmt: skip

    result = {
        "preset": "p", "policies": ["smetric_cost", "least_load"], "seeds": 2,
        "precision": 1.3, "worlds": {"configured": {}, "slow": {"prefill_slowdown": 1.25}},
        "slo": dataclasses.asdict(SLOConfig()), "loose_slo": dataclasses.asdict(SLOConfig()),
        "cells": [
            cell("full", "configured", [110.0, 120.0], [100.0, 100.0]),
            cell("full", "slow", [99.0, 101.0], [100.0, 100.0]),
            cell("free", "configured", [150.0, 150.0], [230.0, 230.0]),
            cell("free", "slow", [150.0, 150.0], [160.0, 160.0]),
        ],
    }  # fmt: skip
    table = robustness_table(result)
    assert "| configured | +15.0 ± 7.1 % |" in table
    assert "| slow | +0.0 ± 1.4 % |" in table
    assert "free" not in table  # ceilings are no cells of the verdict
    rows = grid_table(result)
    assert "| weka · full · sync · H20 · configured | least_load" in rows
    assert "0.2k, best 50%" in rows  # the ceiling: the best of any policy, free tier
    text = grid_markdown(result, "smetric grid")
    assert "`smetric_cost`'s lead in every world" in text
    assert "- `slow`: prefill_slowdown 1.25" in text


def test_a_tiny_robustness_grid_end_to_end(tmp_path: Path) -> None:
    """Two worlds and a ceiling: every world's cells and the ceiling run, the report has
    the lead per world and the ceiling column, and the slower world is no faster."""
    preset, out = tmp_path / "robust.yaml", tmp_path / "out"
    preset.write_text(
        TINY.replace("tiers: {none: 0.02, full: 0.04}", "tiers: {full: 0.04}").replace(
            "seeds: 1",
            "worlds: {configured: {}, slow: {prefill_slowdown: 2.0}}\nceiling: true\nseeds: 1",
        )
    )
    grid(preset, out, "smetric_cost,least_load")
    result = json.loads((out / "grid.json").read_text())
    assert {(c["tier"], c["world"]) for c in result["cells"]} == {
        ("full", "configured"), ("full", "slow"), ("free", "configured"), ("free", "slow"),
    }  # fmt: skip
    text = (out / "grid.md").read_text()
    assert "`smetric_cost`'s lead in every world" in text
    assert "| configured |" in text and "| slow |" in text
    assert "ceiling (best of all)" in text
    assert "Headroom: in " in text
    best = {c["world"]: max(means_of(c).values()) for c in result["cells"] if c["tier"] == "full"}
    assert best["slow"] <= best["configured"]
