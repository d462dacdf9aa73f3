"""The router's HTTP/1.1 client for the requests it forwards to engines.

The engine leg is most of a small request's cost through a router: aiohttp's client costs
85 of the 136 us a bare aiohttp pass-through spends on a tiny request, and 13 of its 23 us
on each streamed chunk (``docs/results/router-performance.md``). This client does what a
forwarded request needs and nothing else: one request at a time per connection,
connections kept per engine for reuse with no cap (a hidden queue in the router would hold
requests past their first-byte timeout and blame healthy engines), replies parsed by
``httptools`` (llhttp, Node's parser) as they arrive, with no cookies, no redirects, no
decompression (the router asks for identity) and no proxies. The router's control traffic
(health checks, scrapes, lookups) stays on aiohttp.

A connection goes back to its engine's idle list only once its reply ended whole, framed
and kept alive, with nothing of the request left unsent; any other end closes it, which is
how an engine learns that nobody wants the rest (vLLM then aborts the request). A reply's
pieces wait for their reader up to ``HIGH_WATER`` bytes, then the engine connection stops
being read until the reader catches up, so a client slow to read holds the engine back
through TCP rather than filling the router's memory.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import NamedTuple, cast
from urllib.parse import urlsplit

import httptools


class ConnectFailed(Exception):
    """No connection to the engine: the request never reached it."""


class ReplyBroken(Exception):
    """The engine's reply cannot go on: what a read of its body raises."""


class ConnectionLost(ReplyBroken):
    """The engine's connection ended before its reply did."""


class NotHttp(ReplyBroken):
    """The engine answered with something that is not an HTTP/1.x response."""


# The most a reply's status line and headers may take (aiohttp's client allows 8 KiB a
# line): past it, an engine is sending something other than a reply's head.
MAX_HEAD = 64 << 10
# A reply's unread bytes past which its engine connection stops being read.
HIGH_WATER = 256 << 10
# How long an idle connection is kept for reuse: under the 5 s after which vLLM's server
# (uvicorn) closes one, so that the router closes it first rather than send a request
# down a connection the engine is closing.
KEEP_IDLE_S = 4.0
# What would end a header line early: a value carrying it could smuggle a header or a
# second request to the engine.
_LINE_BREAK = re.compile(r"[\r\n\0]")


class Origin(NamedTuple):
    """Where an engine listens, as its URL names it."""

    scheme: str
    host: str
    port: int
    host_header: str
    base_path: str


@lru_cache(maxsize=1024)
def origin_of(url: str) -> Origin:
    split = urlsplit(url)
    secure = split.scheme == "https"
    port = split.port or (443 if secure else 80)
    host_header = split.netloc.rpartition("@")[2]
    return Origin(split.scheme, split.hostname or "", port, host_header, split.path.rstrip("/"))


class Reply:
    """One engine reply as it arrives: its status and content type once its head came,
    then its body's pieces, read in order by one reader (``read``), or handed as they
    arrive to a sink (``hand_to``), in the connection's callback: a stream's token then
    goes on to the client without a task woken for it."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.status = 0
        self.content_type = ""
        # Set by the parser: the body's end came; its framing (a length or chunks, else
        # the body runs to the connection's end); the engine keeps the connection open.
        self.complete = False
        self.framed = False
        self.keep_alive = False
        self._pieces: deque[bytes] = deque()
        self._unread = 0
        self._exception: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None

    def ended(self) -> bool:
        """No more of the body will come."""
        return self.complete or self._exception is not None

    def at_eof(self) -> bool:
        """The body came whole and was all read."""
        return self.complete and not self._pieces

    async def read(self) -> bytes:
        """What came of the body since the last read, waiting for some; b"" at its end.
        Raises ``ReplyBroken`` or whatever ``set_exception`` set, at once, even with
        bytes unread."""
        while True:
            if self._exception is not None:
                raise self._exception
            if self._pieces:
                break
            if self.complete:
                return b""
            self._waiter = self.connection.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces = self._pieces
        data = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._unread = 0
        self.connection.resume()
        return data

    def hand_to(self, sink: Callable[[bytes], None] | None) -> None:
        """From now on, hand each piece of the body to ``sink`` as it arrives, those
        already here first; None: keep them for ``read`` again. What ``sink`` raises
        ends the reply with it (never blaming the engine)."""
        self._sink = sink
        if sink is None:
            return
        pieces = self._pieces
        self._unread = 0
        while pieces and self._exception is None:
            self._handed(sink, pieces.popleft())
        pieces.clear()

    def _handed(self, sink: Callable[[bytes], None], data: bytes) -> None:
        # Raised to the reader: raised to the parser, it would blame the engine.
        try:
            sink(data)
        except Exception as exc:
            self.set_exception(exc)

    async def wait(self) -> None:
        """Until the body ended, failed (raising why) or someone woke this (``wake``)."""
        if self._exception is None and not self.complete:
            self._waiter = self.connection.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._exception is not None:
            raise self._exception

    def pause(self) -> None:
        """Stop reading the engine's connection (its data waits in TCP) until ``resume``."""
        self.connection.pause()

    def resume(self) -> None:
        self.connection.resume()

    @property
    def paused(self) -> bool:
        return self.connection.paused

    def set_exception(self, exception: BaseException) -> None:
        """End the read in progress, and every later one, with ``exception``."""
        if self._exception is None:
            self._exception = exception
            self.wake()

    def release(self) -> None:
        """The reader is done: the connection is reused if the reply ended cleanly, else
        closed."""
        self.connection.finished(self)

    def _fed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            if self._exception is None:
                self._handed(sink, data)
            return
        self._pieces.append(data)
        self._unread += len(data)
        if self._unread > HIGH_WATER:
            self.connection.pause()
        self.wake()

    def wake(self) -> None:
        """Wake whoever waits on the reply (``wait``, ``read``)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Connection(asyncio.Protocol):
    """One connection to an engine, carrying one request at a time. The parser's
    callbacks (``on_*``) fill the reply of the request in flight."""

    def __init__(self, client: EngineClient, origin: Origin) -> None:
        self.client = client
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reply: Reply | None = None
        self.head_bytes = 0
        self.head: asyncio.Future[None] | None = None
        self.paused = False
        self.closed = False
        self.idle_since = 0.0

    # -- the request -----------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> Reply:
        assert self.transport is not None and self.reply is None
        self.reply = reply = Reply(self)
        self.head_bytes = 0
        self.head = self.loop.create_future()
        self.transport.writelines((head, body))
        return reply

    def finished(self, reply: Reply) -> None:
        """``reply``'s reader is done with it."""
        if self.reply is not reply:
            return
        self.reply = None
        transport = self.transport
        reusable = (
            reply.complete
            and reply.keep_alive
            and reply._exception is None
            and not self.closed
            and transport is not None
            and not transport.is_closing()
            and transport.get_write_buffer_size() == 0
        )
        if reusable:
            self.resume()
            self.client.idle(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.transport.is_closing():
            self.paused = False
            self.transport.resume_reading()

    # -- asyncio's protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client.forget(self)
        reply = self.reply
        if reply is None or reply.complete:
            return
        if self.head is not None and self.head.done() and not reply.framed:
            reply.complete = True  # a body without length or chunks ends with its connection
            reply.wake()
            return
        lost = ConnectionLost("the engine closed the connection before its reply ended")
        self._fail(lost)

    def data_received(self, data: bytes) -> None:
        if self.reply is None or self.reply.complete:  # an engine talking out of turn
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(NotHttp(f"{type(exc).__name__}: {exc}"))
            return
        head = self.head
        if head is not None and not head.done():  # still in the head
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:
                self._fail(NotHttp(f"a reply's head over {MAX_HEAD} bytes"))

    def _fail(self, exception: Exception) -> None:
        """The connection is unusable: its reply fails, unless it came whole before."""
        self.close()
        if self.head is not None and not self.head.done():
            self.head.set_exception(exception)
        if self.reply is not None and not self.reply.complete:
            self.reply.set_exception(exception)

    # -- httptools' callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.reply is not None
        lowered = name.lower()
        if lowered == b"content-type":
            self.reply.content_type = value.decode("latin-1").partition(";")[0].strip().lower()
        elif lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.reply.framed = True

    def on_headers_complete(self) -> None:
        reply, head = self.reply, self.head
        assert reply is not None and head is not None
        status = self.parser.get_status_code()
        if status < 200:  # an interim reply (100 Continue): the real one follows
            reply.content_type, reply.framed = "", False
            return
        reply.status = status
        head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.reply is not None
        self.reply._fed(body)

    def on_message_complete(self) -> None:
        reply = self.reply
        assert reply is not None
        if reply.status == 0:  # the end of an interim reply
            return
        reply.complete = True
        reply.keep_alive = self.parser.should_keep_alive()
        reply.wake()


class EngineClient:
    """The connections to engines, kept for reuse; ``post`` forwards one request."""

    def __init__(self) -> None:
        self._idle: dict[Origin, list[Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        loop = asyncio.get_running_loop()
        self._sweep = loop.call_later(KEEP_IDLE_S, self._close_stale)

    async def post(
        self, url: str, path: str, body: bytes, headers: Mapping[str, str], connect_s: float
    ) -> Reply:
        """POST ``body`` to ``path`` of the engine at ``url``, connecting within
        ``connect_s`` if no idle connection waits there; the reply once its head came.
        Raises ``ConnectFailed``, ``ConnectionLost`` or ``NotHttp``; cancelled
        while it waits, it closes the connection (the engine then aborts the request)."""
        origin = origin_of(url)
        connection = self._reused(origin) or await self._connect(origin, connect_s)
        lines = [f"POST {origin.base_path}{path} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
        for name, value in headers.items():
            if _LINE_BREAK.search(name) or _LINE_BREAK.search(value):
                continue
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        reply = connection.send(head, body)
        assert connection.head is not None
        try:
            await connection.head
        except BaseException:
            connection.close()
            connection.reply = None
            raise
        return reply

    def _reused(self, origin: Origin) -> Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            if connection.idle_since < time.monotonic() - KEEP_IDLE_S:
                connection.close()
                continue
            return connection
        return None

    async def _connect(self, origin: Origin, connect_s: float) -> Connection:
        loop = asyncio.get_running_loop()
        tls = self._context() if origin.scheme == "https" else None
        try:
            async with asyncio.timeout(connect_s):
                _, connection = await loop.create_connection(
                    lambda: Connection(self, origin), origin.host, origin.port, ssl=tls
                )
        except TimeoutError:
            raise ConnectFailed(f"no connection within {connect_s:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from None
        return connection

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def idle(self, connection: Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin, []).append(connection)

    def forget(self, connection: Connection) -> None:
        """A closed connection leaves the idle list, if it was there."""
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    def _close_stale(self) -> None:
        """Close the connections idle past ``KEEP_IDLE_S``: an engine may keep them open
        for ever, each holding a socket on both ends."""
        cutoff = time.monotonic() - KEEP_IDLE_S
        for idle in self._idle.values():
            for connection in [c for c in idle if c.idle_since < cutoff]:
                connection.close()  # ``connection_lost`` takes it off the list
        self._sweep = asyncio.get_running_loop().call_later(KEEP_IDLE_S, self._close_stale)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the idle connections; those in use close as their replies are released."""
        self._sweep.cancel()
        for idle in list(self._idle.values()):
            for connection in list(idle):
                connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' closing run
