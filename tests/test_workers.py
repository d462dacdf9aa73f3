"""``smetric serve --workers N`` on loopback: one port, every worker seeing every worker's
load and routed prefixes."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from smetric.core.headers import ENGINE_HEADER
from smetric.serve.engines import LOAD_COLUMNS, Engine
from smetric.serve.workers import CrashLoop
from smetric.testing.ports import read_startup_port

from conftest import eventually

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

COMPLETION = {
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
}


def test_load_is_summed_over_workers_in_shared_memory() -> None:
    shared = mmap.mmap(-1, 8 * LOAD_COLUMNS * 2)
    table = np.frombuffer(shared, dtype=np.int64).reshape(2, LOAD_COLUMNS)
    engine = Engine("http://127.0.0.1:1", 16)
    engine.inflight = 1  # counted before the table is shared: moves along
    pid = os.fork()
    if pid == 0:  # another worker's view of the same engine counts in its own row only
        other = Engine("http://127.0.0.1:1", 16)
        other.share_load(table, 1)
        other.inflight += 3
        other.unprefilled += 500
        other.inflight_tokens += 7000
        os._exit(0)
    os.waitpid(pid, 0)
    engine.share_load(table, 0)
    engine.unprefilled += 20
    engine.inflight_tokens += 900
    assert (engine.inflight, engine.unprefilled, engine.inflight_tokens) == (1, 20, 900)
    assert engine.load(time.monotonic(), 5.0) == 4.0
    assert engine.total_unprefilled() == 520
    assert engine.total_inflight_tokens() == 7900
    engine.inflight -= 1
    assert table.tolist() == [[0, 20, 900], [3, 500, 7000]]


class HoldingEngine:
    """An engine that keeps completions open until released and counts what it got."""

    def __init__(self) -> None:
        self.received = 0
        self.release = asyncio.Event()

    async def complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.received += 1
        await self.release.wait()
        return web.json_response(COMPLETION)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/health", self.health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


async def post(url: str, messages: list[dict]) -> aiohttp.ClientResponse:
    """One request on a fresh connection, so the kernel may pick any worker."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as client,
        client.post(url + "/v1/chat/completions", json={"messages": messages}) as reply,
    ):
        await reply.read()
        return reply


async def scenario() -> None:
    engines = [HoldingEngine(), HoldingEngine()]
    started = [await e.start() for e in engines]
    urls = [url for _, url in started]
    args = [sys.executable, "-m", "smetric", "serve", "--port", "0", "--workers", "2"]
    args += ["--log-level", "warning", "--health-interval", "0.2", "-e", urls[0], "-e", urls[1]]
    router = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert router.stdout is not None
        port = await asyncio.to_thread(read_startup_port, router.stdout, router)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as client:

            async def ready() -> bool:
                try:
                    async with client.get(url + "/health") as reply:
                        return reply.status == 200
                except aiohttp.ClientError:
                    return False

            deadline = time.monotonic() + 30
            while not await ready():
                assert router.poll() is None, router.stderr.read().decode()  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "router did not start"
                await asyncio.sleep(0.1)
        assert len(children_of(router.pid)) == 2

        # First turns go to the least loaded engine. Each is held open, and each arrives on
        # a new connection, at whichever worker: only if every worker sees the requests the
        # others routed do the engines stay level.
        sessions = [[{"role": "user", "content": f"task {i} " + "x" * 200}] for i in range(6)]
        pending = []
        for messages in sessions:
            pending.append(asyncio.create_task(post(url, messages)))
            await eventually(lambda: sum(e.received for e in engines) == len(pending), 20.0)
            assert abs(engines[0].received - engines[1].received) <= 1
        for engine in engines:
            engine.release.set()
        replies = await asyncio.gather(*pending)
        assert all(r.status == 200 for r in replies)
        first = replies[0].headers[ENGINE_HEADER]

        # Follow-ups of the first session, on fresh connections: each finds the prefix on
        # the engine that served it, whichever worker routed the earlier turns.
        history = sessions[0]
        for turn in range(6):
            history = [*history, {"role": "assistant", "content": "ok"}]
            history.append({"role": "user", "content": f"and then {turn}"})
            reply = await post(url, history)
            assert reply.status == 200
            assert reply.headers[ENGINE_HEADER] == first
    finally:
        for engine in engines:
            engine.release.set()
        router.terminate()
        router.wait(10)
        for runner, _ in started:
            await runner.cleanup()
    assert router.returncode == 0


def test_two_workers_share_one_port_their_load_and_their_view() -> None:
    asyncio.run(scenario())


async def killed_worker() -> str:
    """``serve --workers 2``: SIGKILL one worker, and every request after it succeeds;
    the supervisor forks a new one in its place and says why the old one went."""
    engine = HoldingEngine()
    engine.release.set()  # answer at once
    runner, engine_url = await engine.start()
    args = [sys.executable, "-m", "smetric", "serve", "--port", "0", "--workers", "2"]
    args += ["--log-level", "warning", "--health-interval", "0.2", "-e", engine_url]
    router = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert router.stdout is not None
        port = await asyncio.to_thread(read_startup_port, router.stdout, router)
        url = f"http://127.0.0.1:{port}"
        messages = [{"role": "user", "content": "hello"}]
        await eventually(lambda: len(children_of(router.pid)) == 2, 20.0)
        for _ in range(20):  # both workers up and serving
            assert (await post(url, messages)).status == 200
        workers = children_of(router.pid)
        os.kill(workers[0], signal.SIGKILL)
        # Fresh connections land on either worker's socket; those on the dead one's wait
        # for its successor.
        replies = await asyncio.gather(*(post(url, messages) for _ in range(40)))
        assert [r.status for r in replies] == [200] * 40
        await eventually(lambda: len(children_of(router.pid)) == 2, 20.0)
        assert workers[0] not in children_of(router.pid) and workers[1] in children_of(router.pid)
        assert router.poll() is None
    finally:
        router.terminate()
        _, stderr = router.communicate(timeout=20)
        await runner.cleanup()
    assert router.returncode == 0, stderr
    return stderr.decode()


def test_a_killed_worker_is_restarted_and_requests_keep_succeeding() -> None:
    log = asyncio.run(killed_worker())
    died = [json.loads(line) for line in log.splitlines() if '"worker_died"' in line]
    assert len(died) == 1 and died[0]["cause"] == "killed by SIGKILL", log


def test_a_crash_loop_backs_off_then_gives_up() -> None:
    crashes = CrashLoop(steady_s=30.0, first_backoff_s=0.5, give_up_after=3)
    assert crashes.died(0, lived_s=100.0) == 0.0  # after a steady life: at once
    assert [crashes.died(0, lived_s=1.0) for _ in range(4)] == [0.5, 1.0, 2.0, None]
    assert crashes.died(1, lived_s=1.0) == 0.5  # each worker has its own count
    assert crashes.died(0, lived_s=31.0) == 0.0  # a steady life starts the count over
    assert crashes.died(0, lived_s=1.0) == 0.5


CRASHING = """
import logging, os, sys
from smetric.serve.logs import log_to_stderr
from smetric.serve.workers import CrashLoop, _supervise

def start(worker):
    pid = os.fork()
    if pid == 0:
        os._exit(3)  # a worker that dies as it starts, every time
    return pid

log_to_stderr(logging.INFO)
_supervise(start, 2, CrashLoop(first_backoff_s=0.01, give_up_after=2))
"""


def test_the_supervisor_gives_up_loudly_on_a_worker_that_keeps_dying() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CRASHING], capture_output=True, timeout=60, text=True
    )
    assert done.returncode == 1, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    died = [e for e in events if e["event"] == "worker_died"]
    assert died and all(e["cause"] == "exit code 3" for e in died)
    assert [e["event"] for e in events].count("worker_gave_up") == 1
    assert [e["restart_in_s"] for e in died if e["worker"] == died[0]["worker"]] == [0.01, 0.02]
