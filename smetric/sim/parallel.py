"""Many simulation runs in parallel: worker processes here, or a Ray cluster.

Each worker loads the trace once (a process) or receives it once through the object store
(a Ray node). A sweep keeps every finished run in a results folder named by the run's
resolved configuration (``RunStore``), so an interrupted sweep, started again on either
backend, runs only what is missing.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import polars as pl

from smetric.core.errors import UserError
from smetric.sim.config import dump_yaml
from smetric.sim.jobs import (
    Events,
    Job,
    Task,
    run_result,
    run_summary,
    run_summary_and_requests,
)
from smetric.sim.ray_runner import map_on_ray
from smetric.sim.result import RunResult
from smetric.trace.load import load_trace
from smetric.trace.schema import Trace

_worker_trace: Trace | None = None


def _exit_with(parent: int) -> None:
    # A sweep stopped by SIGTERM (a job scheduler, `kill`) dies without shutting its pool
    # down, and its workers would run on for the rest of their queued simulations.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def _init(source: str, fmt: str | None, parent: int) -> None:
    global _worker_trace
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    _worker_trace = load_trace(source, fmt)


def _run(job: Job, task: Task) -> tuple[Job, Any]:
    assert _worker_trace is not None
    return job, task(_worker_trace, job)


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
    for job, result in map_jobs(source, fmt, jobs, processes, trace, run_result):
        yield job.key, result


def map_jobs(
    source: str,
    fmt: str | None,
    jobs: list[Job],
    processes: int,
    trace: Trace | None,
    task: Task,
) -> Iterator[tuple[Job, Any]]:
    """``task(trace, job)`` for every job, as they finish, in worker processes."""
    if processes <= 1:
        loaded = trace if trace is not None else load_trace(source, fmt)
        for job in jobs:
            yield job, task(loaded, job)
        return
    # Forking a process that has run polars' thread pool can deadlock the child: spawn.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        processes, mp_context=context, initializer=_init, initargs=(source, fmt, os.getpid())
    ) as pool:
        futures = [pool.submit(_run, job, task) for job in jobs]
        for future in as_completed(futures):
            yield future.result()


class RunStore:
    """Finished runs' summaries, one folder per run named by ``Job.run_id``.

    Each folder holds the run's resolved ``config.yaml`` (to reproduce it alone with
    ``smetric simulate -c``) and its ``summary.json``, written last and atomically, so a
    folder with a summary is a finished run and an interruption leaves none half written.
    A run stored with its per-request table (``requests.parquet``, written before the
    summary) can give that back too; ``written`` counts the runs stored by this object.
    """

    REQUESTS = "requests.parquet"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.written = 0

    def get(self, job: Job, *, with_requests: bool = False) -> dict | None:
        run = self.folder / job.run_id
        path = run / "summary.json"
        if not path.exists() or (with_requests and not (run / self.REQUESTS).exists()):
            return None
        return json.loads(path.read_text())

    def stored(self, job: Job, *, with_requests: bool = False) -> dict:
        """The summary of a run that must be stored already (one a knee search probed)."""
        summary = self.get(job, with_requests=with_requests)
        if summary is None:
            raise UserError(f"{self.folder}: run {job.run_id} is missing")
        return summary

    def requests(self, job: Job) -> pl.DataFrame:
        """The per-request table of a run stored with one."""
        return pl.read_parquet(self.folder / job.run_id / self.REQUESTS)

    def put(self, job: Job, summary: dict, requests: pl.DataFrame | None = None) -> None:
        run = self.folder / job.run_id
        run.mkdir(parents=True, exist_ok=True)
        dump_yaml(job.resolved, run / "config.yaml")
        if requests is not None:
            requests.write_parquet(run / self.REQUESTS)
        partial = run / "summary.json.partial"
        partial.write_text(json.dumps(summary, indent=1))
        partial.replace(run / "summary.json")
        self.written += 1


# Runs finished so far, and runs in flight per node (a node's name for the user).
Progress = Callable[[int, dict[str, int]], None]


def run_sweep(
    jobs: list[Job],
    store: RunStore | None,
    trace: Trace,
    *,
    processes: int,
    ray_address: str | None = None,
    progress: Progress | None = None,
    with_requests: bool = False,
) -> tuple[dict[tuple, dict], int]:
    """Every job's summary by key, running those ``store`` lacks; and how many ran now.

    Runs go to worker processes on this machine, or with ``ray_address`` to a Ray cluster
    (``ray_runner``); either way each lands in ``store`` (if any) the moment it finishes.
    ``with_requests`` stores each run's per-request table too (``RunStore.requests``), and
    counts a stored run without one as missing.
    """
    source, fmt = jobs[0].config.workload.trace, jobs[0].config.workload.format
    done: dict[tuple, dict] = {}
    todo = []
    for job in jobs:
        stored = None if store is None else store.get(job, with_requests=with_requests)
        if stored is None:
            todo.append(job)
        else:
            done[job.key] = stored
    if progress is not None:
        progress(len(done), {})
    task = run_summary_and_requests if with_requests else run_summary
    if ray_address is not None and todo:
        finished = map_on_ray(ray_address, trace, todo, task)
    else:
        finished = _local(source, fmt, todo, processes, trace, task)
    for ran, output, inflight in finished:
        if ran is not None:
            summary, requests = output if with_requests else (output, None)
            if store is not None:
                store.put(ran, summary, requests)
            done[ran.key] = summary
        if progress is not None:
            progress(len(done), inflight)
    return done, len(todo)


# A backend's events: a finished job and its summary, or (None, None) when runs start,
# each with the runs then in flight per node.


def _local(
    source: str, fmt: str | None, jobs: list[Job], processes: int, trace: Trace, task: Task
) -> Events:
    remaining = len(jobs)
    workers = min(processes, remaining)
    yield None, None, {"localhost": workers} if workers else {}
    for job, summary in map_jobs(source, fmt, jobs, workers, trace, task):
        remaining -= 1
        yield job, summary, {"localhost": min(workers, remaining)} if remaining else {}
