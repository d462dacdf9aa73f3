"""One try of one request on one engine: its load, its timeouts, and whose fault it was.

Load must come down on every exit path: the engine answered, broke, stalled or sent
garbage, or the client gave up while the router waited (which cancels the handler, often
before the engine's headers: vLLM sends a non-streaming reply's headers only at its end).
``Attempt`` takes a ``Lease`` on the engine when entered (``engine.inflight``, its
in-flight prompt tokens and its unprefilled tokens), gives the unprefilled tokens back at
the first chunk of the body (the prompt is prefilled by then), and releases the rest when
left, however it is left; it closes the engine's response with it, so a stream nobody
reads stops on the engine.

Reads from the engine raise ``EngineFault`` and nothing else, and nothing here writes to
the client but the caller's own sink (``pass_on``, which raises what the sink raised), so
a caller can tell an engine that failed from a client that hung up (both surface as
connection errors) by what was raised.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType

from smetric.serve.engine_client import (
    ConnectFailed,
    ConnectionLost,
    EngineClient,
    NotHttp,
    Reply,
    ReplyBroken,
)
from smetric.serve.engines import Engine, Lease


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    # Until the engine's response headers arrive. A non-streaming reply's come after the
    # whole completion, so this is also the longest non-streaming generation allowed.
    first_byte_s: float = 300.0
    # Between two reads once the response started: a stream's tokens, a body's pieces.
    idle_s: float = 60.0
    # Until a streaming reply's headers arrive: vLLM sends them as soon as it has taken
    # the request (before the prefill), so a stream without headers by then is stalled.
    stream_headers_s: float = 10.0


def with_key(headers: Mapping[str, str], auth: Mapping[str, str]) -> dict[str, str]:
    """``headers`` with an engine's own key header (``auth``, if any) in place of any key
    the client sent."""
    if not auth:
        return dict(headers)
    keys = ("authorization", "x-api-key")
    return {k: v for k, v in headers.items() if k.lower() not in keys} | dict(auth)


class EngineFault(Exception):
    """The engine, not the client, failed this attempt.

    ``refused``: the request never reached the engine (connecting failed), so trying
    another engine cannot run it twice. ``lost``: the connection is gone (refused, or cut
    mid-way), which a live engine does not do. ``timeout``: the engine went silent.
    ``status`` and ``body``: the engine answered with this 5xx error.
    """

    def __init__(
        self,
        reason: str,
        *,
        refused: bool = False,
        lost: bool = False,
        timeout: bool = False,
        stalled: bool = False,
        status: int | None = None,
        body: bytes = b"",
        detail: str = "",
    ) -> None:
        super().__init__(reason)
        # What the HTTP client said, for the log only: clients get ``reason``.
        self.detail = detail
        self.refused = refused
        self.lost = lost or refused
        self.timeout = timeout or stalled
        self.stalled = stalled
        self.status = status
        self.body = body

    @property
    def kind(self) -> str:
        if self.lost:
            return "lost"
        if self.stalled:
            return "stalled"
        if self.timeout:
            return "timeout"
        return "protocol" if self.status is None else "status"


class Attempt:
    """Sends one request to ``engine`` and reads its reply, counted as in flight there
    from ``async with`` to its end."""

    def __init__(
        self,
        engine: Engine,
        client: EngineClient,
        timeouts: Timeouts,
        prompt_tokens: int,
        unprefilled_tokens: int,
        auth: dict[str, str] | None = None,
    ) -> None:
        self.engine = engine
        # The engine's own key header, which replaces any key the client sent.
        self.auth = auth or {}
        self.client = client
        self.timeouts = timeouts
        self.prompt_tokens = prompt_tokens
        self.unprefilled_tokens = unprefilled_tokens
        self.response: Reply | None = None
        self.lease: Lease | None = None
        self._loop = asyncio.get_running_loop()
        # Why it was cut, and the wait for the response headers while it lasts, which
        # ``cut`` ends at once.
        self._cut: str | None = None
        self._sending: asyncio.Timeout | None = None
        # A read of the body in progress: when its bytes are due (``inf`` while none
        # waits), how long it waits, and the one alarm that bounds all the reads.
        self._due = math.inf
        self._patience = 0.0
        self._alarm: asyncio.TimerHandle | None = None
        # False while the engine's bytes are handed to the client: the engine waits on
        # the client then, not the client on the engine, so its silence is not a stall.
        self.waits_on_engine = True

    async def __aenter__(self) -> Attempt:
        engine = self.engine
        if not engine.waited_on():
            engine.progressed_at = time.monotonic()  # owed nothing until now: silence starts
        engine.attempts.add(self)
        self.lease = Lease(engine, self.prompt_tokens, self.unprefilled_tokens)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.engine.attempts.discard(self)
        assert self.lease is not None
        self.lease.release()
        if self._alarm is not None:
            self._alarm.cancel()
        if self.response is not None:
            # Back to the pool if fully read; otherwise the connection closes, which is how
            # an engine learns that nobody wants the rest (vLLM then aborts the request).
            self.response.release()

    def cut(self, reason: str) -> None:
        """End the wait in progress (and any later one) now: the engine stalled."""
        self._cut = reason
        if self._sending is not None and not self._sending.expired():
            self._sending.reschedule(self._loop.time())
        elif self.response is not None:
            self._end_reads(EngineFault(reason, stalled=True))

    async def deliver(self, write: Awaitable[None]) -> None:
        """Await ``write``, a write of the engine's bytes to the client. However long a
        client takes to read, the engine is not silent meanwhile: it waits for the
        router to read, and the pool's stall watch leaves it be (``waits_on_engine``).
        Unless another attempt waits on it, its silence starts again once the client
        took the bytes, as an idle engine's does at a new attempt."""
        self.waits_on_engine = False
        try:
            await write
        finally:
            self.waits_on_engine = True
            if not self.engine.waited_on(besides=self):
                self.engine.progressed_at = time.monotonic()

    def _stalled(self) -> EngineFault | None:
        return None if self._cut is None else EngineFault(self._cut, stalled=True)

    async def send(
        self, path: str, body: bytes, headers: dict[str, str], stream: bool = False
    ) -> Reply:
        """POST and wait for the response headers, at most ``first_byte_s`` (a streaming
        request: ``stream_headers_s``)."""
        wait = self.timeouts.stream_headers_s if stream else self.timeouts.first_byte_s
        headers = with_key(headers, self.auth)
        # A cut attempt's wait is over before it starts.
        deadline = self._loop.time() + (0.0 if self._cut else wait)
        try:
            async with asyncio.timeout_at(deadline) as self._sending:
                self.response = await self.client.post(
                    self.engine.url, path, body, headers, self.timeouts.connect_s
                )
        except ConnectFailed as exc:
            raise EngineFault(f"connect failed: {exc}", refused=True) from None
        except TimeoutError:
            stalled = self._stalled()
            if stalled is not None:
                raise stalled from None
            what = "response headers of a stream" if stream else "response"
            raise EngineFault(f"no {what} within {wait:g} s", timeout=True) from None
        except ConnectionLost as exc:
            raise EngineFault("connection lost", lost=True, detail=str(exc)) from None
        except NotHttp as exc:
            raise EngineFault("not a valid HTTP response", detail=str(exc)) from None
        finally:
            self._sending = None
        stalled = self._stalled()
        if stalled is not None:  # the headers came as it was cut: its reads fail at once
            self._end_reads(stalled)
        self.engine.progressed_at = time.monotonic()
        return self.response

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The next piece of the body as it arrives, b"" at its end. A wait longer than
        ``timeout_s`` (``idle_s`` by default) or a body cut short is the engine's fault."""
        reply = self.response
        assert reply is not None, "send() first"
        # A body whose end has come (a small reply, whole with its headers) has no wait
        # to bound.
        if not reply.ended():
            self._bound(self.timeouts.idle_s if timeout_s is None else timeout_s)
        try:
            chunk = await reply.read()
        except ReplyBroken as exc:
            raise EngineFault("response cut short", lost=True, detail=str(exc)) from None
        finally:
            self._due = math.inf
        if chunk:
            self.engine.progressed_at = time.monotonic()
            if self.lease is not None:
                self.lease.prefilled()
        return chunk

    async def pass_on(
        self,
        sink: Callable[[bytes], None],
        client: asyncio.WriteTransport,
        drain: Callable[[], Awaitable[None]],
    ) -> None:
        """Hand the rest of the body to ``sink`` (which writes it to the ``client``) as it
        arrives, from the engine connection's callback, until its end: no task wakes per
        token. Bounded as ``read``'s waits are: ``idle_s`` between pieces. While the
        client's transport is past its high-water mark, the engine's connection is not
        read and the attempt waits on the client (``deliver``) until ``drain`` says it
        took the bytes. ``sink`` raising ``ConnectionResetError`` (the client went away)
        ends it with that; an engine that failed, with ``EngineFault``."""
        reply = self.response
        assert reply is not None, "send() first"
        engine, lease, loop = self.engine, self.lease, self._loop
        patience = self.timeouts.idle_s
        high = client.get_write_buffer_limits()[1]
        if lease is not None:
            lease.prefilled()

        def piece(data: bytes) -> None:
            engine.progressed_at = time.monotonic()
            self._due = loop.time() + patience
            sink(data)
            if client.get_write_buffer_size() > high:
                reply.pause()
                reply.wake()

        reply.hand_to(piece)
        try:
            while not reply.complete:
                if reply.paused:
                    self._due = math.inf
                    await self.deliver(drain())
                    reply.resume()
                    continue
                self._bound(patience)
                await reply.wait()
        except ReplyBroken as exc:
            raise EngineFault("response cut short", lost=True, detail=str(exc)) from None
        finally:
            reply.hand_to(None)
            self._due = math.inf

    def _bound(self, seconds: float) -> None:
        """Bound the read about to wait by ``seconds``. A stream reads once per token, so
        its reads share one alarm, moved only when it rings early or a read wants it
        earlier, rather than a timer each; ringing late, it ends the read
        (``_end_reads``)."""
        self._due, self._patience = self._loop.time() + seconds, seconds
        if self._alarm is None or self._alarm.when() > self._due:
            if self._alarm is not None:
                self._alarm.cancel()
            self._alarm = self._loop.call_at(self._due, self._ring)

    def _ring(self) -> None:
        self._alarm = None
        if self._due == math.inf:  # no read waits: the next one sets the alarm again
            return
        if self._loop.time() < self._due:
            self._alarm = self._loop.call_at(self._due, self._ring)
            return
        self._end_reads(EngineFault(f"silent for {self._patience:g} s", timeout=True))

    def _end_reads(self, fault: EngineFault) -> None:
        """End the read in progress, and every later one, with ``fault``: through the
        reply, as a lost connection ends them."""
        assert self.response is not None
        self.response.set_exception(fault)

    async def read_all(self) -> bytes:
        """The whole body: no wait on the engine once it said the body ended."""
        reply = self.response
        assert reply is not None, "send() first"
        parts = [await self.read()]
        while parts[-1] and not reply.at_eof():
            parts.append(await self.read())
        return b"".join(parts)
