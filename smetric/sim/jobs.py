"""A simulation run as a job: its configuration, its policy, and the name it is stored under."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import polars as pl

from smetric.core.policies import resolve_policy
from smetric.sim.config import SimConfig
from smetric.sim.policy import cluster_rates
from smetric.sim.result import RunResult
from smetric.sim.run import simulate
from smetric.trace.schema import Trace


@dataclass(frozen=True)
class Job:
    key: tuple
    config: SimConfig
    policy: str

    @property
    def resolved(self) -> SimConfig:
        """The run's whole configuration: its config with this job's policy alone."""
        return dataclasses.replace(self.config, policies=(self.policy,))

    @property
    def run_id(self) -> str:
        """A name for the run that changes whenever anything that shapes its result does:
        its configuration and every parameter its policy routes with, so a policy default
        changed in the code, or a constant derived from other hardware, is another run
        rather than a stored one reused under the same spec."""
        name, params = resolve_policy(self.policy, cluster_rates(self.config.cluster))
        config = dataclasses.replace(self.config, policies=(name,))
        shape = {**config.to_dict(), "policy_params": params}
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:20]


# What a worker computes for a job: the run, or just its summary (a sweep's runs send
# back no per-request tables).
Task = Callable[[Trace, Job], Any]


def run_result(trace: Trace, job: Job) -> RunResult:
    return simulate(trace, job.config, job.policy)


def run_summary(trace: Trace, job: Job) -> dict:
    return simulate(trace, job.config, job.policy).summary


def run_summary_and_requests(trace: Trace, job: Job) -> tuple[dict, pl.DataFrame]:
    result = simulate(trace, job.config, job.policy)
    return result.summary, result.requests


# Runs as they finish: (the job, what its task returned, progress counts by state).
Events = Iterator[tuple[Job | None, Any, dict[str, int]]]
