"""The paper's larger-model numbers (Figs. 18-20) beside a Qwen3-235B result's."""

from __future__ import annotations

from smetric.eval.paper import comparisons, is_large_model, title
from smetric.eval.preset import load_preset
from smetric.metrics.results import ReproduceResult


def point(tps: float, local: float, remote: float, imbalance: float, ttft: float) -> dict:
    return {
        "tps_within_slo": tps,
        "stdev": 0.0,
        "reuse": {"local": local, "global": remote, "miss": 1 - local - remote},
        "slo_attainment": 0.9,
        "imbalance": imbalance,
        "ttft_s": {"p50": ttft, "p90": 8 * ttft, "p99": 20 * ttft},
        "tpot_s": {"p50": 0.02, "p90": 0.03, "p99": 0.05},
        "stickiness": {"session": 0.5, "agent": 0.6, "turn": 0.9},
    }


def knee(mean: float) -> dict:
    return {"load": 1.0, "mean": mean, "stdev": 0.0, "seeds": [mean], "probes": {1.0: mean}}


def result(model: str) -> ReproduceResult:
    knees = {"smetric": 540.0, "linear": 500.0, "lmetric": 450.0, "least_load": 380.0}
    full = {
        p: {"knee": knee(m), **point(m, 0.69 if p == "smetric" else 0.6, 0.07, 1.6, 0.85)}
        for p, m in knees.items()
    }
    sweep = {
        p: [
            {"tps_within_slo": m * f, "stdev": 0.0, "reuse": point(m, 0.6, 0.1, 1, 1)["reuse"]}
            for f in (0.6, 1.0, 0.9)
        ]
        for p, m in knees.items()
    }
    return ReproduceResult.from_builtins(
        {
            "preset": "large",
            "setup": "a test",
            "trace": "none",
            "config": {"cluster": {"model": model}},
            "seeds": 1,
            "policies": list(knees),
            "tiers": {
                "none": {"policies": full, "best_baseline": "linear"},
                "full": {"policies": full, "best_baseline": "linear"},
            },
            "ceiling": None,
            "load_unit": {
                "rate": 1.0,
                "reference_policy": "linear",
                "reference_knee": 1.5,
                "paper_load": 1.5,
            },
            "rate_sweep": {
                "multiples": [1.0, 1.5, 2.0],
                "rates": [1.0, 1.5, 2.0],
                "policies": sweep,
            },
            "at_paper_load": {
                "rate": 1.5,
                "policies": {p: point(m, 0.6, 0.1, 1.6, 0.85) for p, m in knees.items()},
            },
            "guard": {},
            "sensitivity": {},
        }
    )


def test_a_235b_result_is_set_beside_figures_18_to_20() -> None:
    large = result("Qwen3-235B-A22B-Instruct-2507-FP8")
    assert is_large_model(large) and "Figs. 18-20" in title(large)
    rows = {(r.figure, r.paper): r.ours for r in comparisons(large)}
    assert {figure for figure, _ in rows} == {"18a", "18b", "19b", "20"}
    assert rows["18a", "+8 %"] == "+8.0 %"
    assert rows["18a", "+20 %"].startswith("+20.0 %")
    assert rows["18b", "-32 %"] == "-29.6 %"
    assert rows["19b", "69 % and 76 % (highest)"] == "69 % and 76 % (highest: smetric)"
    assert rows["20", "0.85 s, -24 % vs LMetric"] == "0.85 s, +0.0 % vs LMetric"


def test_the_30b_result_keeps_the_colocation_figures() -> None:
    small = result("Qwen3-Coder-30B-A3B")
    assert not is_large_model(small)
    assert title(small) == "The paper's colocation evaluation"


def test_the_large_preset_is_the_papers_setup() -> None:
    preset = load_preset("large")
    cluster = preset.config.cluster
    assert (cluster.instances, cluster.gpus_per_instance, cluster.hardware) == (8, 4, "H20")
    assert "235B" in cluster.model
    assert "full" in preset.tiers
