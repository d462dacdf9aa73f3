"""An attempt's waits on an engine, against a real aiohttp engine on loopback whose chunks
come when the test says: each read is bounded by its own wait, however long the stream;
a client slow to read costs the engine nothing; a cut ends a read at once; and an
attempt, however it ended, leaves nothing scheduled behind."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from smetric.serve.engine_client import EngineClient
from smetric.serve.engines import Engine
from smetric.serve.upstream import Attempt, EngineFault, Timeouts

from conftest import run

pytestmark = pytest.mark.server

CHUNK = b"data: {}\n\n"


@asynccontextmanager
async def streaming(gaps_s: list[float]) -> AsyncIterator[str]:
    """An engine whose stream sends a chunk after each of ``gaps_s``, then ends."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for gap in gaps_s:
            await asyncio.sleep(gap)
            await response.write(CHUNK)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


def attempt_on(
    url: str, idle_s: float, check: Callable[[Attempt], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """Run ``check`` on a sent attempt whose reads wait at most ``idle_s``."""

    async def go() -> None:
        engine = Engine(url, 16)
        timeouts = Timeouts(connect_s=5, first_byte_s=30, idle_s=idle_s, stream_headers_s=5)
        async with (
            EngineClient() as client,
            Attempt(engine, client, timeouts, 0, 0) as attempt,
        ):
            await attempt.send("/v1/chat/completions", b"{}", {}, stream=True)
            await check(attempt)

    return go


async def read_to_end(attempt: Attempt) -> list[bytes]:
    chunks = []
    while chunk := await attempt.read():
        chunks.append(chunk)
    return chunks


def test_each_read_waits_its_own_time_however_long_the_stream() -> None:
    """Ten chunks 0.1 s apart take a second, over three times the 0.3 s a read may
    wait: no read waited that long, so none failed."""

    async def go() -> None:
        async with streaming([0.1] * 10) as url:

            async def check(attempt: Attempt) -> None:
                assert b"".join(await read_to_end(attempt)) == CHUNK * 10

            await attempt_on(url, 0.3, check)()

    run(go)


def test_a_read_longer_than_its_wait_is_the_engine_s_fault() -> None:
    async def go() -> None:
        async with streaming([0.05, 0.05, 5.0]) as url:

            async def check(attempt: Attempt) -> None:
                assert await attempt.read(timeout_s=10) == CHUNK
                assert await attempt.read() == CHUNK
                started = time.monotonic()
                with pytest.raises(EngineFault, match=r"silent for 0\.3 s") as fault:
                    await attempt.read()
                assert fault.value.timeout and not fault.value.stalled
                # Bounded by the read's own 0.3 s, not the first read's 10 s.
                assert 0.25 < time.monotonic() - started < 2

            await attempt_on(url, 0.3, check)()

    run(go)


def test_a_client_slow_to_read_costs_the_engine_nothing() -> None:
    """Between reads nothing waits on the engine: a second spent writing to a slow
    client, over three times a read's wait, is not the engine's silence."""

    async def go() -> None:
        async with streaming([0.01, 0.01, 0.01]) as url:

            async def check(attempt: Attempt) -> None:
                assert await attempt.read() == CHUNK
                await attempt.deliver(asyncio.sleep(1.0))
                assert b"".join(await read_to_end(attempt)).count(CHUNK) == 2

            await attempt_on(url, 0.3, check)()

    run(go)


def test_a_cut_ends_the_read_in_progress_at_once() -> None:
    async def go() -> None:
        async with streaming([0.01, 30.0]) as url:

            async def check(attempt: Attempt) -> None:
                assert await attempt.read() == CHUNK
                asyncio.get_running_loop().call_later(0.1, attempt.cut, "the engine stalled")
                started = time.monotonic()
                with pytest.raises(EngineFault, match="the engine stalled") as fault:
                    await attempt.read()
                assert fault.value.stalled
                assert time.monotonic() - started < 5

            await attempt_on(url, 60, check)()

    run(go)


def test_a_cut_attempt_fails_its_send_at_once() -> None:
    async def go() -> None:
        async with streaming([0.01]) as url, EngineClient() as client:
            engine = Engine(url, 16)
            async with Attempt(engine, client, Timeouts(), 0, 0) as attempt:
                attempt.cut("the engine stalled")
                with pytest.raises(EngineFault, match="the engine stalled"):
                    await attempt.send("/v1/chat/completions", b"{}", {}, stream=True)

    run(go)


def test_an_attempt_leaves_nothing_scheduled_however_it_ended() -> None:
    """A read bounded by a minute, then the attempt left mid-stream (the client went
    away) or after a fault: nothing the loop holds keeps the attempt alive."""

    async def go() -> None:
        async with streaming([0.01, 0.2, 60.0]) as url:
            left: list[weakref.ref[Attempt]] = []

            async def gone_mid_stream(attempt: Attempt) -> None:
                left.append(weakref.ref(attempt))
                assert await attempt.read() == CHUNK

            async def faulted(attempt: Attempt) -> None:
                left.append(weakref.ref(attempt))
                await attempt.read()
                await attempt.read()
                with pytest.raises(EngineFault):
                    await attempt.read(timeout_s=0.2)

            await attempt_on(url, 60, gone_mid_stream)()
            await attempt_on(url, 60, faulted)()
            gc.collect()
            assert [ref() for ref in left] == [None, None]

    run(go)


@asynccontextmanager
async def client_transport() -> AsyncIterator[asyncio.StreamWriter]:
    """A client's end of a loopback connection, as ``pass_on`` writes to one."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    try:
        yield writer
    finally:
        writer.close()
        server.close()


def test_passing_on_hands_every_chunk_and_bounds_each_wait() -> None:
    """Chunks 0.1 s apart pass on whole, however long the stream, each wait bounded by
    its own 0.3 s; then an engine silent for longer is the engine's fault."""

    async def go() -> None:
        async with client_transport() as client:

            async def whole(attempt: Attempt) -> None:
                assert await attempt.read() == CHUNK
                got: list[bytes] = []
                await attempt.pass_on(got.append, client.transport, client.drain)
                assert b"".join(got) == CHUNK * 9

            async def silent(attempt: Attempt) -> None:
                assert await attempt.read() == CHUNK
                got: list[bytes] = []
                started = time.monotonic()
                with pytest.raises(EngineFault, match=r"silent for 0\.3 s"):
                    await attempt.pass_on(got.append, client.transport, client.drain)
                assert got == [CHUNK] and 0.25 < time.monotonic() - started < 2

            async with streaming([0.1] * 10) as url:
                await attempt_on(url, 0.3, whole)()
            async with streaming([0.05, 0.05, 5.0]) as url:
                await attempt_on(url, 0.3, silent)()

    run(go)


def test_a_cut_ends_passing_on_at_once_and_a_sink_s_error_ends_it_too() -> None:
    async def go() -> None:
        async with streaming([0.01, 0.01, 30.0]) as url, client_transport() as client:

            async def cut(attempt: Attempt) -> None:
                asyncio.get_running_loop().call_later(0.2, attempt.cut, "the engine stalled")
                started = time.monotonic()
                with pytest.raises(EngineFault, match="the engine stalled") as fault:
                    await attempt.pass_on(lambda _: None, client.transport, client.drain)
                assert fault.value.stalled and time.monotonic() - started < 5

            async def client_gone(attempt: Attempt) -> None:
                def gone(chunk: bytes) -> None:
                    raise ConnectionResetError("the client went away")

                with pytest.raises(ConnectionResetError):
                    await attempt.pass_on(gone, client.transport, client.drain)

            await attempt_on(url, 60, cut)()
            await attempt_on(url, 60, client_gone)()

    run(go)
