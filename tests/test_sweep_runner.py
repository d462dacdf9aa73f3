"""Sweeps resume from their results folder, and give the same numbers on Ray as locally."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import statistics
import sys
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from smetric.cli import app
from smetric.sim.config import SimConfig
from smetric.sim.jobs import Job
from smetric.sim.parallel import RunStore
from smetric.sim.seeds import mean_summary

pytestmark = pytest.mark.subprocess

runner = CliRunner()

SWEEP = [
    "sweep",
    "-p",
    "smetric,least_load",
    "--rates",
    "0.05,0.1",
    "--globals",
    "none,1x",
    "--instances",
    "2",
    "--duration",
    "120",
]


def sweep(out: Path, *extra: str) -> tuple[str, dict]:
    result = runner.invoke(app, [*SWEEP, "-o", str(out), *extra])
    assert result.exit_code == 0, result.output
    return result.output, json.loads((out / "sweep.json").read_text())


def test_run_id_follows_the_resolved_config() -> None:
    base = SimConfig()
    job = Job(("a",), base, "smetric")
    assert job.run_id == Job(("other key",), base, "smetric").run_id
    assert job.run_id != Job(("a",), base, "least_load").run_id
    assert job.run_id != Job(("a",), base.override("workload", seed=1), "smetric").run_id
    # The config's policy list is not the run's: only the job's policy counts.
    listed = dataclasses.replace(base, policies=("least_load", "smetric"))
    assert job.run_id == Job(("a",), listed, "smetric").run_id


def test_an_interrupted_sweep_runs_only_what_is_missing(tmp_path: Path) -> None:
    _, first = sweep(tmp_path / "whole", "-j", "1")
    # An interruption: the folder holds some runs, one of them half written.
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "whole" / "runs", part / "runs")
    finished = sorted((part / "runs").iterdir())
    for run in finished[:3]:
        shutil.rmtree(run)
    (finished[3] / "summary.json").rename(finished[3] / "summary.json.partial")
    output, resumed = sweep(part, "-j", "2")
    assert "4 of 8 runs reused" in output
    assert resumed == first
    assert sorted(p.name for p in (part / "runs").iterdir()) == [p.name for p in finished]
    # Everything is there now: nothing runs again.
    output, again = sweep(part, "-j", "2")
    assert "8 of 8 runs reused" in output and again == first


def test_a_sweep_over_two_seeds_is_the_mean_of_the_two_single_seed_sweeps(
    tmp_path: Path,
) -> None:
    # One provisioning is enough here (the last --globals counts).
    _, seed0 = sweep(tmp_path / "s0", "--globals", "none", "--seed", "0")
    _, seed1 = sweep(tmp_path / "s1", "--globals", "none", "--seed", "1")
    output, both = sweep(tmp_path / "both", "--globals", "none", "--seeds", "2")
    assert " ± " in output and both["seeds"] == 2
    assert seed0["runs"] != seed1["runs"]  # the seeds differ, or the mean proves nothing
    for run, a, b in zip(both["runs"], seed0["runs"], seed1["runs"], strict=True):
        assert (run["rate"], run["global"], run["policy"]) == (a["rate"], a["global"], a["policy"])
        tps = [a["summary"]["tps_within_slo"], b["summary"]["tps_within_slo"]]
        assert run["seeds_tps"] == tps
        assert run["summary"]["tps_within_slo"] == statistics.fmean(tps)
        assert run["stdev"] == statistics.stdev(tps)
        assert run["summary"]["slo_attainment"] == statistics.fmean(
            [a["summary"]["slo_attainment"], b["summary"]["slo_attainment"]]
        )
    # The best rate is taken on the mean curve.
    for g, by_policy in both["max_tps"].items():
        for p, best in by_policy.items():
            means = {
                r["rate"]: r["summary"]["tps_within_slo"]
                for r in both["runs"]
                if r["global"] == g and r["policy"] == p
            }
            assert best["tps"] == max(means.values()) == means[best["rate"]]
    # Each seed is its own stored run: the two-seed sweep holds both single-seed sweeps' runs.
    ids = {p.name for d in ("s0", "s1") for p in (tmp_path / d / "runs").iterdir()}
    assert {p.name for p in (tmp_path / "both" / "runs").iterdir()} == ids


def test_more_seeds_rerun_nothing_already_stored(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    sweep(out, "--globals", "none")
    output, _ = sweep(out, "--globals", "none", "--seeds", "2")
    assert "4 of 8 runs reused" in output
    output, _ = sweep(out, "--globals", "none", "--seeds", "2")
    assert "8 of 8 runs reused" in output


def test_store_keeps_the_runs_resolved_config(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    job = Job(("x",), SimConfig(), "smetric")
    assert store.get(job) is None
    store.put(job, {"tps_within_slo": 1.5})
    assert store.get(job) == {"tps_within_slo": 1.5}
    config = (tmp_path / job.run_id / "config.yaml").read_text()
    assert "- smetric\n" in config and "least_load" not in config


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="ray is not installed: pip install 'smetric[ray]' (or .venv/bin/pip install ray)",
)
def test_ray_sweep_matches_the_process_pool(tmp_path: Path) -> None:
    _, local = sweep(tmp_path / "local", "-j", "2", "--seeds", "2")
    # A one-machine Ray cluster started by the sweep itself, on loopback only.
    _, on_ray = sweep(tmp_path / "ray", "--ray", "local", "--seeds", "2")
    assert on_ray == local
    ids = sorted(p.name for p in (tmp_path / "local" / "runs").iterdir())
    assert sorted(p.name for p in (tmp_path / "ray" / "runs").iterdir()) == ids


def test_ray_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    result = runner.invoke(app, [*SWEEP, "-o", str(tmp_path), "--ray", "auto"])
    assert result.exit_code == 2
    assert "pip install 'ray>=2.40,<3'" in result.output


def test_a_run_stored_without_its_requests_counts_as_missing_where_they_are_wanted(
    tmp_path: Path,
) -> None:
    store = RunStore(tmp_path)
    job = Job(("x",), SimConfig(), "smetric")
    store.put(job, {"tps_within_slo": 1.5})
    assert store.get(job) == {"tps_within_slo": 1.5}
    assert store.get(job, with_requests=True) is None
    table = pl.DataFrame({"request_id": [1, 2]})
    store.put(job, {"tps_within_slo": 2.5}, table)
    assert store.get(job, with_requests=True) == {"tps_within_slo": 2.5}
    assert store.requests(job).equals(table)
    assert store.written == 2


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(child) for child in path.read_text().split()} if path.exists() else set()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads Linux's /proc")
def test_workers_of_a_sweep_stopped_by_sigterm_exit_with_it(tmp_path: Path) -> None:
    """SIGTERM kills a sweep without running its pool's shutdown; its workers must not
    run on through the simulations still queued."""
    import signal
    import subprocess
    import time

    command = [sys.executable, "-m", "smetric", *SWEEP, "--duration", "3600", "-j", "2"]
    sweep = subprocess.Popen(
        [*command, "-o", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            # The two workers, and the resource tracker that the spawn context adds.
            workers = {c for c in _children(sweep.pid) if _alive(c)}
        assert len(workers) >= 2, "the sweep never started its workers"
        sweep.send_signal(signal.SIGTERM)
        sweep.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [w for w in workers if _alive(w)]
    finally:
        sweep.kill()
        sweep.wait()


def test_seeds_that_took_different_branches_merge_with_the_missing_counts_as_zero() -> None:
    one = {"tps": 10.0, "branches": {"sticky": 4, "evicted": 2}, "learned": {"rate": 1.0}}
    two = {"tps": 20.0, "branches": {"sticky": 6}}
    merged = mean_summary([one, two])
    assert merged["tps"] == 15.0
    assert merged["branches"] == {"sticky": 5.0, "evicted": 1.0}
    # A section only one seed has is that seed's, not halved.
    assert merged["learned"] == {"rate": 1.0}


def test_a_figure_one_seed_could_not_measure_is_averaged_over_the_seeds_that_did() -> None:
    # A percentile over no requests is None in that seed's summary, first or later.
    later = mean_summary([{"ttft_p90": 2.0}, {"ttft_p90": None}, {"ttft_p90": 4.0}])
    first = mean_summary([{"ttft_p90": None}, {"ttft_p90": 3.0}])
    assert later == {"ttft_p90": 3.0}
    assert first == {"ttft_p90": 3.0}
    assert mean_summary([{"ttft_p90": None}, {"ttft_p90": None}]) == {"ttft_p90": None}
