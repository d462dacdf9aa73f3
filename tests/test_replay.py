"""``smetric replay`` against the router over two mock engines, all on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import polars as pl
from aiohttp.test_utils import TestServer
from typer.testing import CliRunner

from smetric.cli import app
from smetric.cli import replay as replay_command  # noqa: F401  (registers the command)
from smetric.engine import EngineConfig, create_app
from smetric.replay import REQUEST_SCHEMA, Replayer, ReplayOptions
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.trace.load import load_trace


async def replay_through_router(out: Path) -> Replayer:
    engines = [TestServer(create_app(EngineConfig(speed=0.0001)), host="127.0.0.1") for _ in "ab"]
    for server in engines:
        await server.start_server()
    router = Router(
        [Engine(f"http://127.0.0.1:{s.port}", 4096) for s in engines],
        RouterSettings(health_interval_s=60),
    )
    front = TestServer(router.app(), host="127.0.0.1")
    await front.start_server()
    try:
        options = ReplayOptions(
            url=f"http://127.0.0.1:{front.port}",
            rate=4.0,
            duration_s=3.0,
            time_scale=20.0,
            token_scale=100.0,
        )
        replayer = Replayer(load_trace("sample:weka"), options)
        await replayer.run()
        replayer.write(out)
        return replayer
    finally:
        await front.close()
        for server in engines:
            await server.close()


def test_replay_through_the_router_measures_hits_and_engines(tmp_path: Path) -> None:
    asyncio.run(replay_through_router(tmp_path))
    table = pl.read_parquet(tmp_path / "requests-replay.parquet")
    assert set(REQUEST_SCHEMA) <= set(table.columns)
    done = table.filter(pl.col("completed"))
    assert done.height > 5
    assert (done["first_token_s"] <= done["finished_s"]).all()
    follow = done.filter(pl.col("turn") > 0)
    assert follow.height > 0
    assert follow["local_hit_tokens"].sum() / follow["prompt_tokens"].sum() > 0.5
    assert table.filter(pl.col("instance") >= 0)["instance"].n_unique() == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policies"]["replay"]["tps_within_slo"] > 0


def test_unreachable_endpoint_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    result = CliRunner().invoke(app, ["replay", url, "--duration", "1", "-o", str(tmp_path)])
    assert result.exit_code == 2
    assert f"cannot reach {url}" in result.output
    assert "Traceback" not in result.output
