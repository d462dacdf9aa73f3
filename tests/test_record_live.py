"""Record through a live ``smetric serve --record`` while ``smetric replay`` drives the
embedded sample at it, then analyze, simulate and replay the recording."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import msgspec
import polars as pl
import pytest
from aiohttp.test_utils import TestServer
from typer.testing import CliRunner

from smetric.cli import app
from smetric.engine import EngineConfig, create_app
from smetric.record.recorder import Recorder, RecordSettings
from smetric.replay import Replayer, ReplayOptions
from smetric.serve.app import Router, RouterSettings
from smetric.serve.disagg import Disaggregation
from smetric.serve.engines import Engine
from smetric.testing.ports import read_startup_port
from smetric.trace.analysis import analyze
from smetric.trace.load import load_trace
from smetric.trace.recording import read_segments
from smetric.trace.schema import SCHEMA, Trace, finalize

pytestmark = pytest.mark.server

# The recording's ideal reuse ratio, and each share of its breakdown, may differ from the
# replayed requests' by this much (absolute): the router cuts the synthesised text into
# 16-byte blocks where the sample has its own blocks of real content, so block boundaries,
# partial last blocks and a system prompt shared at another length move them a little
# either way (measured: 0.010 on the ratio, 0.014 on the shares).
REUSE_TOLERANCE = 0.03


async def _ready(url: str, router: subprocess.Popen[bytes]) -> None:
    assert router.stderr is not None
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as client:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with client.get(url + "/health") as reply:
                    if reply.status == 200:
                        return
            assert router.poll() is None, router.stderr.read().decode()
            assert time.monotonic() < deadline, "router did not start"
            await asyncio.sleep(0.1)


async def record_a_replay(folder: Path) -> Replayer:
    engines = [
        TestServer(create_app(EngineConfig(speed=0.0001)), host="127.0.0.1") for _ in range(2)
    ]
    for server in engines:
        await server.start_server()
    args = [sys.executable, "-m", "smetric", "serve", "--port", "0", "--log-level",
            "warning", "--record", str(folder), "--record-rotate", "0.5"]  # fmt: skip
    for server in engines:
        args += ["-e", f"http://127.0.0.1:{server.port}"]
    router = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert router.stdout is not None and router.stderr is not None
        port = await asyncio.to_thread(read_startup_port, router.stdout, router)
        url = f"http://127.0.0.1:{port}"
        await _ready(url, router)
        options = ReplayOptions(url, rate=4.0, duration_s=4.0, time_scale=20.0, token_scale=100.0)
        replayer = Replayer(load_trace("sample:weka"), options)
        await replayer.run()
    finally:
        router.send_signal(signal.SIGTERM)  # the router writes what it still holds
        router.wait(20)
        for server in engines:
            await server.close()
    assert router.returncode == 0, router.stderr.read().decode()
    return replayer


def replayed(replayer: Replayer) -> Trace:
    """The source trace's requests that the replay completed, as a trace of their own."""
    done = [r.request_id for r in replayer.records.values() if r.finished_s is not None]
    rows = replayer.workload.requests.filter(pl.col("request_id").is_in(done))
    rows = rows.select(list(SCHEMA)).drop("request_id", "parent_id")
    return Trace(finalize(rows), "replayed", "weka", has_clock=False)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Replayer]:
    folder = tmp_path_factory.mktemp("record") / "recording"
    return folder, asyncio.run(record_a_replay(folder))


def test_the_recording_holds_every_request_served(recording: tuple[Path, Replayer]) -> None:
    folder, replayer = recording
    trace = load_trace(folder)
    done = [r for r in replayer.records.values() if r.finished_s is not None]
    assert len(done) > 20
    # Every completed request (by its prompt's size, which the engine reported to the
    # client and the router counted alike), and the ones cut at the replay's end.
    assert trace.num_requests <= len(replayer.records)
    rows = trace.requests
    missing = Counter(r.prompt_tokens for r in done) - Counter(rows["input_tokens"].to_list())
    assert not missing
    assert rows["engine" if "engine" in rows.columns else "session_id"].n_unique() > 1
    follow = rows.filter(pl.col("turn") > 0)
    linked = follow["parent_id"].is_not_null().mean()  # the share of follow-ups with a parent
    assert follow.height > 0 and isinstance(linked, float) and linked > 0.9
    # Turns as replayed, arrival order, and times from a clock shared by all sessions.
    assert sorted(rows["turn"].value_counts()["turn"].to_list())[0] == 0
    assert (rows["duration_s"] > 0).all() and trace.has_clock
    assert (rows.filter(pl.col("think_time_s").is_not_null())["think_time_s"] >= 0).all()
    assert sum(1 for _ in folder.glob("requests-*.parquet")) >= 2  # rotated


def test_the_recording_s_reuse_matches_the_source_trace(
    recording: tuple[Path, Replayer],
) -> None:
    folder, replayer = recording
    measured = analyze(load_trace(folder)).reuse
    source = analyze(replayed(replayer)).reuse
    assert measured.measurable and measured.ratio > 0.5
    assert abs(measured.ratio - source.ratio) <= REUSE_TOLERANCE, (measured, source)
    # Where the reuse comes from: the session's own history, or the shared system prompt.
    split = msgspec.structs.asdict(measured.breakdown)
    for part, share in msgspec.structs.asdict(source.breakdown).items():
        assert abs(split[part] - share) <= REUSE_TOLERANCE, part


def test_the_recording_simulates_and_analyzes_from_the_command_line(
    recording: tuple[Path, Replayer], tmp_path: Path
) -> None:
    folder, _ = recording
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["simulate", str(folder), "--open-loop", "--instances", "2", "--duration", "10",
         "-p", "smetric,least_load", "-o", str(tmp_path / "sim"), "-j", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    for policy in ("smetric", "least_load"):
        run = summary["policies"][policy]
        assert run["requests"]["completed"] > 20 and run["reuse"]["local"] > 0.3
    result = runner.invoke(app, ["analyze", str(folder), "-o", str(tmp_path / "an")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "an" / "analysis.json").read_text())["trace"]["has_clock"]


def test_the_recording_replays_at_its_own_arrivals(recording: tuple[Path, Replayer]) -> None:
    folder, _ = recording

    async def replay() -> Replayer:
        engine = TestServer(create_app(EngineConfig(speed=0.0001)), host="127.0.0.1")
        await engine.start_server()
        try:
            options = ReplayOptions(
                f"http://127.0.0.1:{engine.port}", arrivals="recorded", duration_s=2.0
            )
            again = Replayer(load_trace(folder), options)
            await again.run()
            return again
        finally:
            await engine.close()

    again = asyncio.run(replay())
    done = [r for r in again.records.values() if r.finished_s is not None]
    assert len(done) > 5 and any(r.turn > 0 and r.cached_tokens > 0 for r in done)


def test_harness_headers_name_the_session_and_the_spawning_agent(tmp_path: Path) -> None:
    """Claude Code's headers, through the router: a root agent and the sub-agent it
    spawns share a session, and the sub-agent's first call continues the root's."""

    async def scenario() -> None:
        engine = TestServer(create_app(EngineConfig(speed=0.0001)), host="127.0.0.1")
        await engine.start_server()
        recorder = Recorder(RecordSettings(tmp_path, salt=b"a salt for this test only"))
        router = Router(
            [Engine(f"http://127.0.0.1:{engine.port}", 4096)],
            RouterSettings(health_interval_s=60),
            recorder=recorder,
        )
        front = TestServer(router.app(), host="127.0.0.1")
        await front.start_server()
        root = {"x-claude-code-session-id": "s-1", "x-claude-code-agent-id": "root"}
        child = {**root, "x-claude-code-agent-id": "sub", "x-claude-code-parent-agent-id": "root"}
        task = [{"role": "user", "content": "fix the build " * 20}]
        calls = [
            (root, task),
            (root, [*task, {"role": "assistant", "content": "on it"},
                    {"role": "tool", "content": "log " * 40}]),
            (child, [{"role": "user", "content": "find the failing test " * 20}]),
        ]  # fmt: skip
        try:
            async with aiohttp.ClientSession() as client:
                for headers, messages in calls:
                    body = {"messages": messages, "max_tokens": 4}
                    async with client.post(
                        f"http://127.0.0.1:{front.port}/v1/chat/completions",
                        json=body,
                        headers=headers,
                    ) as reply:
                        assert reply.status == 200
                        await reply.read()
        finally:
            await front.close()  # the router's shutdown writes the last segment
            await engine.close()

    asyncio.run(scenario())
    rows = load_trace(tmp_path).requests
    assert rows.height == 3 and rows["session_id"].n_unique() == 1
    assert rows["agent_id"].to_list()[:2] == ["main", "main"]
    assert rows["trigger"].to_list() == ["user", "agent", "agent"]
    assert rows["parent_id"].to_list() == [None, 0, 1]
    assert rows["output_tokens"].to_list() == [4, 4, 4]


def test_a_disaggregated_request_is_recorded_under_its_prefill_engine(tmp_path: Path) -> None:
    async def scenario() -> list[str]:
        roles = ("prefill", "prefill", "decode")
        servers = [
            TestServer(create_app(EngineConfig(speed=0.0001, role=r)), host="127.0.0.1")
            for r in roles
        ]
        for server in servers:
            await server.start_server()
        urls = [f"http://127.0.0.1:{s.port}" for s in servers]
        router = Router(
            [Engine(u, 4096) for u in urls],
            RouterSettings(health_interval_s=60),
            disagg=Disaggregation(frozenset(urls[:2]), frozenset(urls[2:])),
            recorder=Recorder(RecordSettings(tmp_path, salt=b"a salt for this test only")),
        )
        front = TestServer(router.app(), host="127.0.0.1")
        await front.start_server()
        history = [{"role": "user", "content": "plan the change " * 30}]
        try:
            async with aiohttp.ClientSession() as client:
                for turn in range(3):
                    body = {"messages": history, "max_tokens": 4, "stream": turn % 2 == 0}
                    url = f"http://127.0.0.1:{front.port}/v1/chat/completions"
                    async with client.post(url, json=body) as reply:
                        assert reply.status == 200
                        await reply.read()
                    history = [*history, {"role": "assistant", "content": "ok"}]
                    history.append({"role": "user", "content": f"next {turn} " * 10})
        finally:
            await front.close()
            for server in servers:
                await server.close()
        return urls

    urls = asyncio.run(scenario())
    rows = read_segments(tmp_path)[0]
    assert rows.height == 3 and set(rows["engine"]) <= set(urls[:2])
    shortest = rows["branch"].str.len_chars().min()
    assert isinstance(shortest, int) and shortest > 0
    assert load_trace(tmp_path).requests["parent_id"].to_list() == [None, 0, 1]
