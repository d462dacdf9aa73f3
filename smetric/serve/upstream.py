"""One try of one request on one engine: its load, its timeouts, and whose fault it was.

Load must come down on every exit path: the engine answered, broke, stalled or sent
garbage, or the client gave up while the router waited (which cancels the handler, often
before the engine's headers: vLLM sends a non-streaming reply's headers only at its end).
``Attempt`` raises ``engine.inflight``, its in-flight prompt tokens and its unprefilled
tokens when entered, gives the unprefilled tokens back at the first chunk of the body (the
prompt is prefilled by then), and lowers the rest when left, however it is left; it closes
the engine's response with it, so a stream nobody reads stops on the engine.

Reads from the engine raise ``EngineFault`` and nothing else, and nothing here writes to
the client, so a caller can tell an engine that failed from a client that hung up (both
surface as connection errors in aiohttp) by which call raised.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType

import aiohttp

from smetric.serve.engines import Engine, QueuedPrefill


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    # Until the engine's response headers arrive. A non-streaming reply's come after the
    # whole completion, so this is also the longest non-streaming generation allowed.
    first_byte_s: float = 300.0
    # Between two reads once the response started: a stream's tokens, a body's pieces.
    idle_s: float = 60.0


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
        status: int | None = None,
        body: bytes = b"",
    ) -> None:
        super().__init__(reason)
        self.refused = refused
        self.lost = lost or refused
        self.timeout = timeout
        self.status = status
        self.body = body

    @property
    def kind(self) -> str:
        if self.lost:
            return "lost"
        if self.timeout:
            return "timeout"
        return "protocol" if self.status is None else "status"


class Attempt:
    """Sends one request to ``engine`` and reads its reply, counted as in flight there
    from ``async with`` to its end."""

    def __init__(
        self,
        engine: Engine,
        client: aiohttp.ClientSession,
        timeouts: Timeouts,
        prompt_tokens: int,
        unprefilled_tokens: int,
    ) -> None:
        self.engine = engine
        self.client = client
        self.timeouts = timeouts
        self.prompt_tokens = prompt_tokens
        self.unprefilled_tokens = unprefilled_tokens
        self.response: aiohttp.ClientResponse | None = None
        self.prefill: QueuedPrefill | None = None

    async def __aenter__(self) -> Attempt:
        self.engine.inflight += 1
        self.engine.inflight_tokens += self.prompt_tokens
        self.prefill = QueuedPrefill(self.engine, self.unprefilled_tokens)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.engine.inflight -= 1
        self.engine.inflight_tokens -= self.prompt_tokens
        assert self.prefill is not None
        self.prefill.done()
        if self.response is not None:
            # Back to the pool if fully read; otherwise the connection closes, which is how
            # an engine learns that nobody wants the rest (vLLM then aborts the request).
            self.response.release()

    async def send(self, path: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """POST and wait for the response headers, at most ``first_byte_s``."""
        try:
            async with asyncio.timeout(self.timeouts.first_byte_s):
                self.response = await self.client.post(
                    self.engine.url + path, data=body, headers=headers
                )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise EngineFault(f"connect failed: {exc}", refused=True) from None
        except TimeoutError:
            raise EngineFault(
                f"no response within {self.timeouts.first_byte_s:g} s", timeout=True
            ) from None
        except aiohttp.ClientConnectionError as exc:
            raise EngineFault(f"connection lost: {exc!r}", lost=True) from None
        except aiohttp.ClientError as exc:  # not HTTP, or not HTTP we can parse
            raise EngineFault(f"bad response: {exc!r}") from None
        return self.response

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The next piece of the body as it arrives, b"" at its end. A wait longer than
        ``timeout_s`` (``idle_s`` by default) or a body cut short is the engine's fault."""
        assert self.response is not None, "send() first"
        wait = self.timeouts.idle_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(wait):
                chunk = await self.response.content.readany()
        except TimeoutError:
            raise EngineFault(f"silent for {wait:g} s", timeout=True) from None
        except aiohttp.ClientError as exc:
            raise EngineFault(f"response cut short: {exc!r}", lost=True) from None
        if chunk and self.prefill is not None:
            self.prefill.done()
        return chunk

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)
