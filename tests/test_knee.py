"""The knee search: where it probes, when it stops, and what it reports."""

from __future__ import annotations

import math

import pytest

from smetric.sim.knee import KneeSettings, best_of, knee_of, next_load


def search(curve, settings: KneeSettings) -> dict[float, float]:
    probes: dict[float, float] = {}
    while (load := next_load(probes, settings)) is not None:
        probes[load] = curve(load)
    return probes


def peaked(at: float):
    """A knee at ``at``: rising in proportion to load, then falling off faster."""
    return lambda load: load if load <= at else max(0.0, at - 3 * (load - at))


@pytest.mark.parametrize("start", [0.01, 0.1, 0.37, 1.0, 5.0])
def test_search_brackets_the_knee_within_its_precision(start: float) -> None:
    settings = KneeSettings(start=start, precision=1.2)
    probes = search(peaked(0.37), settings)
    best = max(probes, key=lambda rate: probes[rate])
    assert 0.37 / 1.2 <= best <= 0.37 * 1.2
    assert len(probes) <= settings.max_probes


def test_first_steps_double_then_bisect_the_wider_gap_in_log_space() -> None:
    settings = KneeSettings(start=0.1)
    probes = {0.1: 1.0}
    assert next_load(probes, settings) == pytest.approx(0.2)
    probes |= {0.2: 3.0, 0.4: 2.0}
    # Best 0.2, neighbours 2x away on both sides: the upper gap is bisected first.
    assert next_load(probes, settings) == pytest.approx(math.sqrt(0.2 * 0.4))
    probes[math.sqrt(0.08)] = 2.5
    assert next_load(probes, settings) == pytest.approx(math.sqrt(0.1 * 0.2))


def test_a_start_past_the_knee_steps_down_and_the_probe_cap_stops_a_dead_curve() -> None:
    settings = KneeSettings(start=1.0, max_probes=4)
    assert next_load({1.0: 5.0, 2.0: 1.0}, settings) == pytest.approx(0.5)
    assert search(lambda load: 0.0, settings) == {1.0: 0.0, 2.0: 0.0, 0.5: 0.0, 0.25: 0.0}


def test_knee_reports_mean_and_spread_over_seeds_at_the_best_load() -> None:
    knee = knee_of({0.1: [10.0, 12.0], 0.2: [20.0, 24.0], 0.4: [5.0, 5.0]})
    assert (knee.load, knee.mean) == (0.2, 22.0)
    assert knee.stdev == pytest.approx(math.sqrt(8))
    assert knee.probes == {0.1: 11.0, 0.2: 22.0, 0.4: 5.0}


def test_a_rate_sweep_point_above_the_searched_knee_becomes_the_maximum() -> None:
    knee = knee_of({1.0: [10.0, 12.0], 2.0: [20.0, 22.0], 4.0: [15.0, 15.0]})
    assert knee.load == 2.0
    # A sweep point between the probes beat them: it is the policy's maximum now.
    better = best_of(knee, {2.5: [23.0, 25.0], 3.0: [19.0, 19.0]})
    assert (better.load, better.mean, better.seeds) == (2.5, 24.0, (23.0, 25.0))
    assert better.probes == {1.0: 11.0, 2.0: 21.0, 2.5: 24.0, 3.0: 19.0, 4.0: 15.0}
    # Points below it leave the knee as it was.
    assert best_of(knee, {3.0: [19.0, 19.0]}).load == 2.0
