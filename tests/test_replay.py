"""``smetric replay`` against the router over two mock engines, all on loopback."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from aiohttp.test_utils import TestServer
from typer.testing import CliRunner

from smetric.cli import app
from smetric.cli import replay as replay_command  # noqa: F401  (registers the command)
from smetric.engine import EngineConfig, create_app
from smetric.replay import REQUEST_SCHEMA, Replayer, ReplayOptions
from smetric.serve.app import Router, RouterSettings
from smetric.serve.disagg import Disaggregation
from smetric.serve.engines import Engine
from smetric.trace.load import load_trace

from conftest import closed_port

pytestmark = pytest.mark.server


async def replay_through_router(
    out: Path, trace: str = "sample:weka", roles: tuple[str, ...] = ("both", "both"), **options: Any
) -> Replayer:
    """Mock engines of these roles behind a router (disaggregated if any decodes)."""
    engines = [
        TestServer(create_app(EngineConfig(speed=0.0001, role=role)), host="127.0.0.1")
        for role in roles
    ]
    for server in engines:
        await server.start_server()
    urls = [f"http://127.0.0.1:{s.port}" for s in engines]
    by_role = {
        r: frozenset(u for u, role in zip(urls, roles, strict=True) if role == r) for r in roles
    }
    disagg = Disaggregation(by_role["prefill"], by_role["decode"]) if "decode" in roles else None
    router = Router(
        [Engine(u, 4096) for u in urls], RouterSettings(health_interval_s=60), disagg=disagg
    )
    front = TestServer(router.app(), host="127.0.0.1")
    await front.start_server()
    try:
        defaults = ReplayOptions(
            url=f"http://127.0.0.1:{front.port}",
            rate=4.0,
            duration_s=3.0,
            time_scale=20.0,
            token_scale=100.0,
        )
        replayer = Replayer(load_trace(trace), replace(defaults, **options))
        await replayer.run()
        replayer.write(out)
        return replayer
    finally:
        await front.close()
        for server in engines:
            await server.close()


def test_replay_through_the_router_measures_hits_and_engines(tmp_path: Path) -> None:
    replayer = asyncio.run(replay_through_router(tmp_path))
    table = pl.read_parquet(tmp_path / "requests-replay.parquet")
    assert set(REQUEST_SCHEMA) <= set(table.columns)
    done = table.filter(pl.col("completed"))
    assert done.height > 5
    assert (done["first_token_s"] <= done["finished_s"]).all()
    follow = done.filter(pl.col("turn") > 0)
    assert follow.height > 0
    # The router's own prediction comes back with every response.
    assert all(r.predicted_hit_tokens is not None for r in replayer.records.values() if r.engine)
    assert int(follow["local_hit_tokens"].sum()) / int(follow["prompt_tokens"].sum()) > 0.5
    assert table.filter(pl.col("instance") >= 0)["instance"].n_unique() == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policies"]["replay"]["tps_within_slo"] > 0


def test_recorded_arrivals_are_replayed_open_loop_at_the_trace_s_clock(tmp_path: Path) -> None:
    replayer = asyncio.run(
        replay_through_router(
            tmp_path, "sample:mooncake", arrivals="recorded", duration_s=3.0, time_scale=30.0
        )
    )
    trace = load_trace("sample:mooncake").requests
    recorded = trace.filter(pl.col("arrival_s") < 60.0).sort("arrival_s")["arrival_s"]
    table = pl.read_parquet(tmp_path / "requests-replay.parquet").sort("request_id")
    # Every request of the first 60 trace seconds went out, each at its arrival / 30. The
    # replay runs a second longer than those 2 s, so that a busy machine's event-loop lag
    # does not cut off the last of them (what is in flight at the end is cancelled).
    table = table.filter(pl.col("request_id") < recorded.len())
    assert table.height == recorded.len() > 20
    lag = table["arrival_s"].to_numpy() - recorded.to_numpy() / 30.0
    assert lag.min() >= -1e-3 and lag.max() < 0.5
    # Inferred follow-ups carry their parent's conversation, so they hit its cache.
    follow = table.filter(pl.col("completed") & (pl.col("turn") > 0))
    assert follow.height > 0 and follow["local_hit_tokens"].sum() > 0
    assert replayer.issuer is None


def test_recorded_arrivals_scale_by_sampling_sessions() -> None:
    trace = load_trace("sample:mooncake")

    def workload(sample: float, seed: int = 0) -> pl.DataFrame:
        options = ReplayOptions("http://127.0.0.1:9", arrivals="recorded", duration_s=1e6)
        options = replace(options, sample=sample, seed=seed)
        return Replayer(trace, options).workload.requests

    full, half = workload(1.0), workload(0.5)
    assert full.height == trace.num_requests
    assert 0.35 < half["session_id"].n_unique() / full["session_id"].n_unique() < 0.65
    assert half.equals(workload(0.5))  # seeded
    assert not half.equals(workload(0.5, seed=1))
    with pytest.raises(ValueError, match="--sample scales recorded arrivals"):
        Replayer(trace, ReplayOptions("http://127.0.0.1:9", sample=0.5))


def test_recorded_arrivals_need_a_clock(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["replay", "http://127.0.0.1:9", "--arrivals", "recorded", "-o", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "no global clock" in result.output
    assert "Traceback" not in result.output


def test_unreachable_endpoint_is_a_clear_error(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    result = CliRunner().invoke(app, ["replay", url, "--duration", "1", "-o", str(tmp_path)])
    assert result.exit_code == 2
    assert f"cannot reach {url}" in result.output
    assert "Traceback" not in result.output


def test_report_shows_simulated_and_measured_runs_side_by_side(tmp_path: Path) -> None:
    measured, simulated, out = tmp_path / "measured", tmp_path / "simulated", tmp_path / "out"
    asyncio.run(replay_through_router(measured))
    small = ["--instances", "2", "--duration", "60", "--rate", "0.1", "--jobs", "1"]
    args = ["simulate", "-p", "smetric,least_load", *small, "-o", str(simulated)]
    assert CliRunner().invoke(app, args).exit_code == 0
    result = CliRunner().invoke(app, ["report", str(simulated), str(measured), "-o", str(out)])
    assert result.exit_code == 0, result.output
    for row in ("simulated/smetric", "simulated/least_load", "measured/replay"):
        assert row in result.output
    figures = sorted(p.name for p in out.glob("*.png"))
    assert figures == sorted(
        f"{name}.png" for name in ("tps", "reuse", "imbalance", "heatmaps", "latency", "stickiness")
    )


def test_report_of_a_folder_that_is_not_a_result_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "summary.json (not a" in result.output
    assert "Traceback" not in result.output


def test_replay_against_a_disaggregated_router_measures_prefill_tps_and_ttft(
    tmp_path: Path,
) -> None:
    asyncio.run(replay_through_router(tmp_path, roles=("prefill", "prefill", "decode")))
    table = pl.read_parquet(tmp_path / "requests-replay.parquet")
    done = table.filter(pl.col("completed"))
    assert done.height > 5
    assert (done["prefill_ttft_s"] <= done["ttft_s"]).all()  # the decode's first token comes after
    assert set(done["instance"]) == {0, 1} and set(done["decode_instance"]) == {0}
    assert (done["transfer_tokens"] > 0).all()  # the decode engine pulled every prompt
    follow = done.filter(pl.col("turn") > 0)
    assert follow["local_hit_tokens"].sum() > 0  # the prefill engines' own hits
    summary = json.loads((tmp_path / "summary.json").read_text())["policies"]["replay"]
    assert summary["pd"]["mode"] == "full"
    assert summary["pd"]["prefill_tps_within_slo"] > 0
    met = done.filter(pl.col("met_slo"))
    assert summary["tps_within_slo"] == pytest.approx(int(met["prompt_tokens"].sum()) / 3.0)
