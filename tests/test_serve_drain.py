"""SIGTERM drains ``smetric serve``: it stops accepting at once, lets the requests in flight
finish within ``--drain-timeout``, cuts what is left then, and exits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from smetric.testing.fault_suite import SmetricProcess

pytestmark = pytest.mark.subprocess


def refuses(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex(("127.0.0.1", port)) != 0


async def stream_through_sigterm(router: SmetricProcess, max_tokens: int) -> tuple[bytes, float]:
    """A stream started before SIGTERM: what the client got, and when the port closed."""
    payload = {
        "model": "m",
        "messages": [{"role": "user", "content": "walk the repository and fix the tests"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    assert router.process is not None
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client,
        client.post(router.url + "/v1/chat/completions", json=payload) as response,
    ):
        assert response.status == 200
        received = await response.content.readline()
        os.kill(router.process.pid, signal.SIGTERM)
        signalled = time.monotonic()
        while not refuses(router.port):  # no new connections from now on
            assert time.monotonic() - signalled < 5, "still accepting after SIGTERM"
            await asyncio.sleep(0.05)
        closed = time.monotonic() - signalled
        with contextlib.suppress(aiohttp.ClientPayloadError):  # cut when the drain ends
            received += await response.read()
    return received, closed


@contextlib.contextmanager
def router_draining(scratch: Path, drain_s: str) -> Iterator[SmetricProcess]:
    """A mock engine and ``smetric serve --drain-timeout drain_s`` in front of it, ready."""
    engine = SmetricProcess(scratch, args=("engine", "--speed", "1"))
    router = SmetricProcess(scratch)
    try:
        engine.start()
        engine.wait_listening(90)
        router.args = ("serve", "-e", engine.url, "--drain-timeout", drain_s)
        router.start()
        engine.wait_ready(90)
        router.wait_ready(90)
        yield router
    finally:
        router.stop()
        engine.stop()


def test_sigterm_lets_the_stream_in_flight_finish_then_exits(tmp_path: Path) -> None:
    with router_draining(tmp_path, "30") as router:
        received, closed = asyncio.run(stream_through_sigterm(router, max_tokens=300))
        assert closed < 5
        assert received.rstrip().endswith(b"data: [DONE]")  # finished, not cut
        assert router.process is not None
        assert router.process.wait(30) == 0


def test_what_outlasts_the_drain_timeout_is_cut(tmp_path: Path) -> None:
    with router_draining(tmp_path, "1") as router:
        started = time.monotonic()
        received, _ = asyncio.run(stream_through_sigterm(router, max_tokens=3000))
        assert not received.rstrip().endswith(b"data: [DONE]")
        assert router.process is not None
        router.process.wait(15)
        assert time.monotonic() - started < 15  # the drain ended it, not the stream's end
