"""Simulation and sweep figures: every PNG renders, degenerate runs too, colours stay put."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib.image
import msgspec
import numpy as np
import polars as pl
import pytest
from matplotlib.colors import to_rgba
from matplotlib.patches import Rectangle

from smetric.metrics.results import RunSummary, Stickiness, SweepResult
from smetric.report.palette import HUES, policy_color, policy_colors
from smetric.report.simulation import (
    SweepFigures,
    _max_tps_figure,
    _tps_figure,
    sweep_figures,
    write_simulation_pngs,
    write_sweep_pngs,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
POLICIES = ("smetric:overload=1.5", "linear:lam=0.95", "least_load")
PROVISIONINGS = ["none", "full"]
RATES = [0.1, 0.2, 0.4]
SIMULATION_PNGS = ["tps", "reuse", "imbalance", "heatmaps", "latency", "stickiness"]
SWEEP_PNGS = ["max_tps", "tps_vs_rate", "reuse_by_provisioning"]


def _percentiles(values: np.ndarray) -> dict[str, float | None]:
    if len(values) == 0:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{p}": float(np.percentile(values, p)) for p in (50, 90, 99)}


def make_table(rng: np.random.Generator, completed: int, pending: int = 5) -> pl.DataFrame:
    """Per-request rows shaped like ``with_latencies``: TPOT is 0.0 for one-token replies."""
    outputs = rng.integers(1, 400, completed + pending)
    outputs[:3] = 1
    ttft = rng.lognormal(0.0, 1.2, completed + pending)
    tpot = np.where(outputs > 1, rng.lognormal(-3.5, 0.4, completed + pending), 0.0)
    done = np.arange(completed + pending) < completed
    return pl.DataFrame(
        {
            "ttft_s": [float(t) if d else None for t, d in zip(ttft, done, strict=True)],
            "tpot_s": tpot,
            "completed": done,
            "output_tokens": outputs,
        },
        schema_overrides={"ttft_s": pl.Float64},
    )


def make_summary(
    rng: np.random.Generator,
    table: pl.DataFrame,
    *,
    tps: float,
    local: float,
    remote: float,
    skew: float,
    stickiness: float | None,
) -> dict[str, Any]:
    """A run summary as ``summarize`` builds it, with latencies taken from ``table``."""
    done = table.filter(pl.col("completed"))
    heat = rng.gamma(2.0, 5_000.0, (8, 40))
    heat[int(rng.integers(8))] *= skew
    series = (heat.max(axis=0) / heat.mean(axis=0)).tolist()
    return {
        "horizon_s": 2_400.0,
        "warmup_s": 0.0,
        "window_s": 60.0,
        "requests": {
            "issued": table.height,
            "completed": done.height,
            "met_slo": done.height // 2,
            "rejected": 0,
            "unfinished": table.height - done.height,
            "preemptions": 0,
        },
        "tps_within_slo": tps * 0.8,
        "tps": tps,
        "slo_attainment": 0.8 if done.height else 0.0,
        "ttft_s": _percentiles(done["ttft_s"].to_numpy()),
        "tpot_s": _percentiles(done.filter(pl.col("output_tokens") > 1)["tpot_s"].to_numpy()),
        "reuse": {
            "prompt_tokens": 1_000_000,
            "local": local,
            "global": remote,
            "miss": 1 - local - remote,
        },
        "imbalance": {
            "mean": float(np.mean(series)),
            "p50": float(np.percentile(series, 50)),
            "p90": float(np.percentile(series, 90)),
            "max": float(np.max(series)),
            "series": series,
        },
        "load_heatmap": heat.tolist(),
        "stickiness": {"session": stickiness, "agent": stickiness, "turn": stickiness},
        "branches": {"stick": 10, "balance": 5},
        "global_tier_bytes": 1e9,
        "busy_fraction": [0.5] * 8,
    }


def make_run(
    seed: int = 3,
) -> tuple[dict[str, RunSummary], dict[str, pl.DataFrame]]:
    rng = np.random.default_rng(seed)
    shapes = {
        POLICIES[0]: {"tps": 9_000.0, "local": 0.64, "remote": 0.1, "skew": 2.0, "sticky": 0.93},
        POLICIES[1]: {"tps": 8_000.0, "local": 0.65, "remote": 0.08, "skew": 3.0, "sticky": 0.97},
        POLICIES[2]: {"tps": 7_500.0, "local": 0.06, "remote": 0.67, "skew": 1.0, "sticky": 0.04},
    }
    tables = {p: make_table(rng, 200) for p in POLICIES}
    summaries = {
        p: RunSummary.from_builtins(
            make_summary(
                rng,
                tables[p],
                tps=s["tps"],
                local=s["local"],
                remote=s["remote"],
                skew=s["skew"],
                stickiness=s["sticky"],
            )
        )
        for p, s in shapes.items()
    }
    return summaries, tables


def figures(sweep: dict[str, Any]) -> SweepFigures:
    """What the sweep figures draw of a sweep in its JSON form."""
    return sweep_figures(SweepResult.from_builtins(sweep))


def make_sweep() -> dict[str, Any]:
    """Three policies x two provisionings x three rates, saturating at the middle rate."""
    rng = np.random.default_rng(11)
    table = make_table(rng, 20)
    runs: list[dict[str, Any]] = []
    for g, level in enumerate(PROVISIONINGS):
        for i, policy in enumerate(POLICIES):
            for rate in RATES:
                tps = (1 + g) * (3 - i) * 1_000 * min(rate, 0.2) / (1 + (rate > 0.2))
                summary = make_summary(
                    rng,
                    table,
                    tps=tps,
                    local=0.6 - 0.2 * i,
                    remote=0.3 * g,
                    skew=1.0 + i,
                    stickiness=None,
                )
                runs.append({"rate": rate, "global": level, "policy": policy, "summary": summary})
    best: dict[str, dict[str, dict[str, float]]] = {}
    for run in runs:
        slot = best.setdefault(run["global"], {})
        tps = run["summary"]["tps_within_slo"]
        if run["policy"] not in slot or tps > slot[run["policy"]]["tps"]:
            slot[run["policy"]] = {"tps": tps, "rate": run["rate"]}
    return {
        "rates": RATES,
        "provisionings": PROVISIONINGS,
        "policies": list(POLICIES),
        "runs": runs,
        "max_tps": best,
    }


def assert_readable_pngs(pngs: dict[str, Path], names: list[str]) -> None:
    assert list(pngs) == names
    for name, path in pngs.items():
        assert path.name == f"{name}.png"
        assert path.read_bytes().startswith(PNG_SIGNATURE)
        assert path.stat().st_size > 10_000
        pixels = matplotlib.image.imread(path)
        assert min(pixels.shape[:2]) > 200
        assert pixels.std() > 0  # something was drawn, not a blank canvas


def test_simulation_pngs(tmp_path: Path) -> None:
    summaries, tables = make_run()
    assert_readable_pngs(write_simulation_pngs(summaries, tables, tmp_path), SIMULATION_PNGS)


def test_sweep_pngs(tmp_path: Path) -> None:
    assert_readable_pngs(write_sweep_pngs(figures(make_sweep()), tmp_path), SWEEP_PNGS)


def test_idle_policy_and_missing_latencies_render(tmp_path: Path) -> None:
    """A policy that completed nothing has None latencies, no busy window, no follow-ups."""
    summaries, tables = make_run()
    idle = "round_robin"
    tables[idle] = make_table(np.random.default_rng(0), 0)
    nothing = make_summary(
        np.random.default_rng(0),
        tables[idle],
        tps=0.0,
        local=0.0,
        remote=0.0,
        skew=1.0,
        stickiness=None,
    )
    nothing["imbalance"] = dict.fromkeys(("mean", "p50", "p90", "max"), math.nan)
    nothing["imbalance"]["series"] = []
    nothing["load_heatmap"] = [[0.0] * 40 for _ in range(8)]
    nothing["reuse"] = {"prompt_tokens": 0, "local": 0.0, "global": 0.0, "miss": 0.0}
    summaries[idle] = RunSummary.from_builtins(nothing)
    assert summaries[idle].ttft_s.p50 is None and summaries[idle].tpot_s.p99 is None
    assert_readable_pngs(write_simulation_pngs(summaries, tables, tmp_path), SIMULATION_PNGS)


def test_zero_tps_sweep_renders(tmp_path: Path) -> None:
    sweep = make_sweep()
    for run in sweep["runs"]:
        run["summary"]["tps_within_slo"] = 0.0
    for slot in sweep["max_tps"].values():
        for best in slot.values():
            best.update(tps=0.0, rate=RATES[0])
    assert_readable_pngs(write_sweep_pngs(figures(sweep), tmp_path), SWEEP_PNGS)


def test_a_policy_has_one_colour_whatever_shares_its_figure() -> None:
    colors = policy_colors(POLICIES)
    assert list(colors) == list(POLICIES)
    assert len(set(colors.values())) == len(POLICIES)
    # Other policies, another order: the same colour for each (simulate's list against
    # reproduce's or grid's).
    shuffled = policy_colors(["round_robin", *reversed(POLICIES), "smetric_cost"])
    assert all(shuffled[p] == colors[p] == policy_color(p) for p in POLICIES)
    # Every registered policy has a hue of its own; a variant is a shade of its base.
    assert len(set(HUES.values())) == len(HUES)
    assert policy_color("smetric_cost") == HUES["smetric_cost"]
    variants = policy_colors(["linear", "linear:lam=0.3", "linear:lam=0.5", "linear:lam=0.7"])
    assert len(set(variants.values())) == 4 and variants["linear"] == HUES["linear"]


def _bar_colours(figure: Any) -> set[tuple[float, ...]]:
    return {patch.get_facecolor() for ax in figure.axes for patch in ax.patches}


@pytest.mark.parametrize("policy", POLICIES)
def test_run_and_sweep_draw_a_policy_in_the_same_colour(policy: str) -> None:
    summaries, _ = make_run()
    sweep = make_sweep()
    colour = to_rgba(policy_colors(summaries)[policy])
    assert colour == to_rgba(policy_colors(sweep["policies"])[policy])
    assert colour in _bar_colours(_tps_figure(summaries, policy_colors(summaries)))
    assert colour in _bar_colours(_max_tps_figure(figures(sweep), policy_colors(sweep["policies"])))


def test_the_stickiness_figure_plots_what_its_title_and_the_tables_say() -> None:
    from smetric.report.simulation import _stickiness_figure

    base = make_run()[0][POLICIES[0]]
    summaries = {
        "smetric": msgspec.structs.replace(
            base, stickiness=Stickiness(session=0.68, agent=0.76, turn=0.9)
        ),
        "least_load": msgspec.structs.replace(
            base, stickiness=Stickiness(session=0.1, agent=None, turn=0.2)
        ),
    }
    fig = _stickiness_figure(summaries, {"smetric": "C0", "least_load": "C1"})
    ax = fig.axes[0]
    assert "session's first instance" in ax.get_title() and "agent's" in ax.get_title()
    widths = []
    for bar in ax.patches:
        assert isinstance(bar, Rectangle)  # the bars of a bar chart
        widths.append(round(bar.get_width(), 2))
    widths.sort()
    assert widths == [0.0, 0.1, 0.68, 0.76]
    labels = [text.get_text() for text in ax.texts]
    assert "session: 68.0%" in labels or any("session: 68" in t for t in labels)
