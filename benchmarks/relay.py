"""A pass-through whose streamed replies skip aiohttp's stream API: each chunk the engine
sends goes on to the client from the engine connection's ``data_received``, with no task
woken, no coroutine, no future per chunk. The bound of what a relay on SMetric's server
stack (aiohttp's server, uvloop) could cost a chunk; ``passthrough.py --protocol-relay``
serves it, and ``--protocol-reads`` the same engine leg read a chunk at a time by the
handler, as a router's code would read it through an API.

It is a measuring stick, not a router: connections of its own to the engines (kept for
reuse), parsed with ``httptools``; no timeouts, and no backpressure (a client slower to
read than the engine to write would grow the client transport's buffer), which a real
relay would need: pause the engine connection's reads while the client's transport is
above its high-water mark.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import cast
from urllib.parse import urlsplit

import httptools
from aiohttp import web


class EngineReply(asyncio.Protocol):
    """One engine connection, one request at a time. The body is kept until the handler
    names the client's transport (``to_client``); from then on each piece goes straight
    there, framed as a chunk of the client's chunked reply."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reset()

    def reset(self) -> None:
        loop = asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.content_type = ""
        self.kept: list[bytes] = []
        self.client: asyncio.Transport | None = None
        self.headers = loop.create_future()
        self.body_started = loop.create_future()
        self.done = loop.create_future()
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        for waiter in (self.headers, self.body_started, self.done):
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("the engine closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value.decode("latin-1").split(";")[0].strip()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers.set_result(None)

    def on_body(self, body: bytes) -> None:
        client = self.client
        if client is None:
            self.kept.append(body)
            if not self.body_started.done():
                self.body_started.set_result(None)
            self._wake()
            return
        client.writelines((b"%x\r\n" % len(body), body, b"\r\n"))

    def on_message_complete(self) -> None:
        if not self.body_started.done():
            self.body_started.set_result(None)
        self.done.set_result(None)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next_piece(self) -> bytes:
        """What came of the body since the last call, b"" at its end: a reader woken once
        a chunk, as a handler reading the reply through an API rather than a callback."""
        while not self.kept:
            if self.done.done():
                return b""
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        pieces, self.kept = self.kept, []
        return b"".join(pieces)

    def to_client(self, client: asyncio.BaseTransport) -> None:
        """Send the rest of the body to ``client`` as it arrives."""
        self.client = cast(asyncio.Transport, client)


def app(engines: list[str], callbacks: bool = True) -> web.Application:
    """The relay in front of ``engines``; ``callbacks=False`` reads a stream's chunks in
    the handler (``EngineReply.next_piece``) and writes each through aiohttp's response,
    waking a task per chunk: the same engine leg behind the API a router's code reads."""
    turns = itertools.cycle(urlsplit(url) for url in engines)
    idle: dict[tuple[str, int], list[EngineReply]] = {}

    async def engine_for(host: str, port: int) -> EngineReply:
        pool = idle.setdefault((host, port), [])
        while pool:
            reply = pool.pop()
            if reply.transport is not None and not reply.transport.is_closing():
                reply.reset()
                return reply
        loop = asyncio.get_running_loop()
        _, reply = await loop.create_connection(EngineReply, host, port)
        return reply

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        engine = next(turns)
        host, port = engine.hostname or "127.0.0.1", engine.port or 80
        reply = await engine_for(host, port)
        assert reply.transport is not None
        head = (
            f"POST {request.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        reply.transport.writelines((head.encode("latin-1"), body))
        await reply.headers
        response: web.StreamResponse
        if reply.content_type != "text/event-stream":
            await reply.done
            response = web.Response(
                body=b"".join(reply.kept), status=reply.status, content_type=reply.content_type
            )
        else:
            response = web.StreamResponse(
                status=reply.status, headers={"Content-Type": reply.content_type}
            )
            await response.prepare(request)
            if not callbacks:
                while piece := await reply.next_piece():
                    await response.write(piece)
                await response.write_eof()
                idle[host, port].append(reply)
                return response
            await reply.body_started
            # aiohttp sends the headers with the first write: the kept pieces go that way,
            # and whatever comes after goes straight to the client's transport.
            first, reply.kept = reply.kept, []
            await response.write(b"".join(first))
            later, reply.kept = reply.kept, []
            assert request.transport is not None
            reply.to_client(request.transport)
            for piece in later:  # came during the write: in order, before any newer one
                reply.on_body(piece)
            await reply.done
            await response.write_eof()
        idle[host, port].append(reply)
        return response

    application = web.Application(client_max_size=64 << 20)
    application.router.add_post("/v1/chat/completions", forward)
    return application
