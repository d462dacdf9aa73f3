"""The router's client for forwarded requests, against real servers on loopback: an aiohttp
engine, or a scripted one that answers whatever bytes the test says. Connections are
reused only after a reply ended cleanly; a reader slow to read holds the engine back;
nothing a client sends can add a header; replies framed every way HTTP/1.1 allows are
read whole, and broken ones fail as the engine's fault."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestServer

from smetric.serve.engine_client import (
    MAX_HEAD,
    ConnectFailed,
    ConnectionLost,
    EngineClient,
    NotHttp,
    Reply,
)

from conftest import closed_port, run

pytestmark = pytest.mark.server


@asynccontextmanager
async def aiohttp_engine(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    keepalive_timeout: float = 75.0,
) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    test_server = TestServer(app, host="127.0.0.1", keepalive_timeout=keepalive_timeout)
    await test_server.start_server()
    try:
        yield f"http://127.0.0.1:{test_server.port}"
    finally:
        await test_server.close()


@asynccontextmanager
async def scripted(answer: bytes, *, then_close: bool = True) -> AsyncIterator[str]:
    """An engine that reads a request's head and answers ``answer``, bytes as they are."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        if then_close:
            writer.close()
        else:
            await reader.read()  # until the client closes

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def read_all(reply: Reply) -> bytes:
    parts = []
    while part := await reply.read():
        parts.append(part)
    return b"".join(parts)


async def post(client: EngineClient, url: str, headers: dict[str, str] | None = None) -> Reply:
    return await client.post(url, "/v1/chat/completions", b"{}", headers or {}, 5.0)


def test_a_connection_is_reused_only_after_its_reply_came_whole() -> None:
    """Two replies read whole share a connection; a stream left before its end closes
    its connection, and the next request opens another."""

    async def go() -> None:
        peers: list[int] = []

        async def answer(request: web.Request) -> web.StreamResponse:
            assert request.transport is not None
            peers.append(request.transport.get_extra_info("peername")[1])
            if len(peers) != 3:
                return web.json_response({"n": len(peers)})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: {}\n\n")
            await asyncio.sleep(0.5)
            await response.write(b"data: {}\n\n")
            return response

        async with aiohttp_engine(answer) as url, EngineClient() as client:
            for _ in range(2):
                reply = await post(client, url)
                assert reply.status == 200 and reply.content_type == "application/json"
                assert await read_all(reply) == b'{"n": %d}' % len(peers)
                reply.release()
            reply = await post(client, url)
            assert reply.content_type == "text/event-stream"
            assert await reply.read() == b"data: {}\n\n"
            reply.release()
            reply = await post(client, url)
            await read_all(reply)
            reply.release()
        assert peers[0] == peers[1] == peers[2] != peers[3]


def test_a_reader_slow_to_read_holds_the_engine_back() -> None:
    """An engine streams 64 MiB as fast as it can while the reader sleeps: it gets no
    further than what the sockets and the reply's own bound hold; then all of it arrives,
    in order."""
    total, piece = 64 << 20, 64 << 10

    async def go() -> None:
        written = 0

        async def flood(request: web.Request) -> web.StreamResponse:
            nonlocal written
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for i in range(total // piece):
                await response.write(bytes([i % 251]) * piece)
                written += piece
            await response.write_eof()
            return response

        async with aiohttp_engine(flood) as url, EngineClient() as client:
            reply = await post(client, url)
            await asyncio.sleep(1.0)
            held_back = written
            body = await read_all(reply)
            reply.release()
        assert held_back < total // 2, held_back
        assert len(body) == total
        assert (
            body[piece * 7 : piece * 7 + 1] == bytes([7]) and body[-1] == (total // piece - 1) % 251
        )

    run(go)


def test_no_header_value_can_add_a_header_or_a_request() -> None:
    async def go() -> None:
        seen: list[dict[str, str]] = []

        async def answer(request: web.Request) -> web.Response:
            seen.append(dict(request.headers))
            return web.json_response({})

        smuggled = {
            "x-request-id": "a\r\nx-injected: 1",
            "traceparent": "b\nGET /admin HTTP/1.1",
            "x-ok": "kept",
        }
        async with aiohttp_engine(answer) as url, EngineClient() as client:
            reply = await post(client, url, smuggled)
            await read_all(reply)
            reply.release()
        assert len(seen) == 1
        headers = {k.lower(): v for k, v in seen[0].items()}
        assert headers["x-ok"] == "kept"
        assert "x-injected" not in headers and "x-request-id" not in headers
        assert "traceparent" not in headers

    run(go)


def test_a_body_without_length_or_chunks_runs_to_the_connection_s_end() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n{}"

    async def go() -> None:
        async with scripted(answer) as url, EngineClient() as client:
            reply = await post(client, url)
            assert await read_all(reply) == b"{}"
            reply.release()

    run(go)


def test_an_interim_reply_is_passed_over() -> None:
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
    )

    async def go() -> None:
        async with scripted(answer) as url, EngineClient() as client:
            reply = await post(client, url)
            assert (reply.status, reply.content_type) == (201, "text/plain")
            assert await read_all(reply) == b"ok"
            reply.release()

    run(go)


@pytest.mark.parametrize(
    ("answer", "fails"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n", NotHttp),
        (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * MAX_HEAD, NotHttp),
        (b"HTTP/1.1 200 OK\r\nContent-Len", ConnectionLost),
        (b"", ConnectionLost),
    ],
    ids=["not-http", "endless-head", "head-cut-short", "closed-unanswered"],
)
def test_a_broken_reply_fails_before_its_head(answer: bytes, fails: type[Exception]) -> None:
    async def go() -> None:
        async with scripted(answer) as url, EngineClient() as client:
            with pytest.raises(fails):
                await post(client, url)

    run(go)


def test_a_body_cut_short_fails_its_read() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"

    async def go() -> None:
        async with scripted(answer) as url, EngineClient() as client:
            reply = await post(client, url)
            with pytest.raises(ConnectionLost):
                await read_all(reply)
            reply.release()

    run(go)


def test_a_connection_the_engine_closed_while_idle_is_not_reused() -> None:
    async def go() -> None:
        async def answer(request: web.Request) -> web.Response:
            return web.json_response({})

        async with aiohttp_engine(answer, keepalive_timeout=0.1) as url, EngineClient() as client:
            for _ in range(2):
                reply = await post(client, url)
                assert await read_all(reply) == b"{}"
                reply.release()
                await asyncio.sleep(0.5)  # the engine closes the idle connection

    run(go)


def test_a_refused_connection_and_a_cancelled_wait() -> None:
    """Nothing listening: ``ConnectFailed``. A wait for the head given up: the engine sees
    the connection close (vLLM would abort the request)."""

    async def go() -> None:
        async with EngineClient() as client:
            with pytest.raises(ConnectFailed):
                await post(client, f"http://127.0.0.1:{closed_port()}")
            closed = asyncio.Event()

            async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await reader.readuntil(b"\r\n\r\n")
                await reader.read()  # no answer, until the client closes
                closed.set()
                writer.close()

            server = await asyncio.start_server(never, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            try:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.3):
                        await post(client, url)
                async with asyncio.timeout(10):
                    await closed.wait()
            finally:
                server.close()

    run(go)


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
def test_an_https_engine_is_reached_over_tls_checked_against_trusted_authorities(
    trusted: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine at an ``https`` URL whose certificate a trusted authority signed answers;
    one the machine does not trust is never sent the request."""
    authority = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(served)
    if trusted:
        authority.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))

    async def go() -> None:
        async def answer(request: web.Request) -> web.Response:
            return web.json_response({"secure": request.secure})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=served)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with EngineClient() as client:
                if not trusted:
                    with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                        await post(client, f"https://127.0.0.1:{port}")
                    return
                reply = await post(client, f"https://127.0.0.1:{port}")
                assert await read_all(reply) == b'{"secure": true}'
                reply.release()
        finally:
            await runner.cleanup()

    run(go)
