"""Many simulation runs in worker processes, each worker loading the trace once."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from smetric.sim.config import SimConfig
from smetric.sim.run import RunResult, simulate
from smetric.trace.load import load_trace
from smetric.trace.schema import Trace

_worker_trace: Trace | None = None


@dataclass(frozen=True)
class Job:
    key: tuple
    config: SimConfig
    policy: str


def _init(source: str, fmt: str | None) -> None:
    global _worker_trace
    _worker_trace = load_trace(source, fmt)


def _run(job: Job) -> tuple[tuple, RunResult]:
    assert _worker_trace is not None
    return job.key, simulate(_worker_trace, job.config, job.policy)


def default_jobs(runs: int) -> int:
    return max(1, min(runs, os.cpu_count() or 1))


def run_jobs(
    source: str,
    fmt: str | None,
    jobs: list[Job],
    processes: int,
    trace: Trace | None = None,
) -> Iterator[tuple[tuple, RunResult]]:
    """Results as they finish; with one process, runs in this one on ``trace`` if given."""
    if processes <= 1:
        loaded = trace if trace is not None else load_trace(source, fmt)
        for job in jobs:
            yield job.key, simulate(loaded, job.config, job.policy)
        return
    # Forking a process that has run polars' thread pool can deadlock the child: spawn.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        processes, mp_context=context, initializer=_init, initargs=(source, fmt)
    ) as pool:
        futures = [pool.submit(_run, job) for job in jobs]
        for future in as_completed(futures):
            yield future.result()
