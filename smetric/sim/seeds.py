"""One run's summary over several seeds: each number's mean, so that a sweep over seeds
reports and plots a cell the way it would a single run, and the spread of its headline."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def mean_summary(summaries: Sequence[Any]) -> Any:
    """The seeds' summaries merged: numbers averaged, sections merged key by key, anything
    else (a label, a list) taken from the first seed, where all seeds agree on it."""
    first = summaries[0]
    if isinstance(first, dict):
        return {key: mean_summary([s[key] for s in summaries]) for key in first}
    if isinstance(first, int | float) and not isinstance(first, bool):
        return statistics.fmean(summaries)
    return first


def spread(values: Sequence[float]) -> float:
    """The sample standard deviation over seeds (0 for one seed)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0
