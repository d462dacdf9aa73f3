"""What one simulation run gives back, colocated or disaggregated."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import polars as pl

from smetric.core.policies import Learning
from smetric.metrics.results import RunSummary
from smetric.sim.cluster import ClusterShape
from smetric.sim.instance import Instance


@dataclass(frozen=True)
class RunResult:
    policy: str
    requests: pl.DataFrame
    summary: RunSummary
    shape: ClusterShape
    # Every parameter the policy ran with, hardware-derived ones included (model/calibrate.py).
    policy_params: dict[str, float]


def with_simulated(
    summary: RunSummary,
    tiered: Sequence[Instance],
    instances: Sequence[Instance],
    learning: Learning | None,
) -> RunSummary:
    """The summary with what only the simulator sees: bytes the ``tiered`` instances moved
    over the global tier, each instance's busy share of the horizon, and what the policy
    learned (the final estimates and from how many completed requests), if it learns."""
    horizon = summary.horizon_s
    learner = None if learning is None else learning.learner
    return msgspec.structs.replace(
        summary,
        global_tier_bytes=sum(i.tier_route.bytes_moved for i in tiered),
        busy_fraction=[i.busy_time / horizon for i in instances],
        learned_params=None if learner is None else dict(learner.learned()),
        learned_from=None if learner is None else learner.observed,
    )
