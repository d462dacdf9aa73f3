"""What one simulation run gives back, colocated or disaggregated."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from smetric.sim.cluster import ClusterShape


@dataclass(frozen=True)
class RunResult:
    policy: str
    requests: pl.DataFrame
    summary: dict
    shape: ClusterShape
    # Every parameter the policy ran with, hardware-derived ones included (model/calibrate.py).
    policy_params: dict[str, float]
