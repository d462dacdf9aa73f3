"""One run's summary over several seeds: each number's mean, so that a sweep over seeds
reports and plots a cell the way it would a single run, and the spread of its headline."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def mean_summary(summaries: Sequence[Any]) -> Any:
    """The seeds' summaries merged: numbers averaged, sections merged key by key, anything
    else (a label, a list) taken from the first seed, where all seeds agree on it.

    A number some seeds lack is a count they never made (a routing branch one seed never
    took), so it counts as zero there; a section some lack is merged over those that have
    it. A None is a figure a seed could not measure (a percentile over no requests), so the
    mean is over the seeds that measured it."""
    first = summaries[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(key for s in summaries for key in s)
        return {key: mean_summary(_present(summaries, key)) for key in keys}
    measured = [value for value in summaries if value is not None]
    if measured and all(_is_number(value) for value in measured):
        return statistics.fmean(measured)
    return first


def _present(summaries: Sequence[dict[str, Any]], key: str) -> list[Any]:
    values = [s[key] for s in summaries if key in s]
    numeric = any(_is_number(value) for value in values)
    return [s.get(key, 0) for s in summaries] if numeric else values


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def spread(values: Sequence[float]) -> float:
    """The sample standard deviation over seeds (0 for one seed)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0
