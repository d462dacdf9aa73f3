"""Forwarding: a request's attempts on engines, the relay of their replies, what they used.

A request that fails before any byte reached the client (the engine refused, stalled,
answered 5xx or garbage) is retried on another engine, so it may run more than once
(at-least-once); once the client has bytes, a failure ends the response with an error
(a stream: an error event in the API's own shape, ``serve.errors``, and no
``data: [DONE]``).

Every request the router dispatched ends in one ``Completion``: where it went, what the
engine reported cached, its time to first token and how long its stream took, who sent
it, and how it ended. Each of ``Forwarder.observers`` is called with it once the response
has ended (however it ended), outside the response's path: an observer that raises is
logged and the next one still runs. Recorders and online learners hang off this one hook.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType

import msgspec
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from smetric.core.conversation import RequestFacts
from smetric.serve.engines import Engine
from smetric.serve.errors import dialect_for
from smetric.serve.identity import ANONYMOUS, IDENTITY_HEADERS, AgentIdentity
from smetric.serve.metrics import RouterMetrics
from smetric.serve.pool import EnginePool
from smetric.serve.refusals import Refusal
from smetric.serve.routing import Routed
from smetric.serve.upstream import Attempt, EngineFault, Timeouts
from smetric.trace.schema import Trigger

log = logging.getLogger("smetric.serve")

# Request headers passed on to engines as they are: the API's version and betas, tracing,
# and who sent it. The client's key only when the router has no keys of its own and the
# engine none either (``Attempt.send``).
_CLIENT_KEYS = ("Authorization", "x-api-key")
_PASSED_HEADERS = (
    "anthropic-version",
    "anthropic-beta",
    "x-request-id",
    "traceparent",
    "tracestate",
    *IDENTITY_HEADERS,
)
# Header mappings that are looked up case-insensitively already.
_CASE_INSENSITIVE = (CIMultiDictProxy, CIMultiDict)


class Outcome(StrEnum):
    """How a dispatched request ended, as whoever ended it says."""

    COMPLETED = "completed"  # the engine's whole response reached the client
    ENGINE_ERROR = "engine_error"  # the client got an error response, not the engine's reply
    CUT = "cut"  # a stream broke off mid-way (an error event ends it)
    CLIENT_GONE = "client_gone"  # the client hung up first


@dataclass
class Completion:
    """One dispatched request, as it ended; filled in along its path."""

    api: str
    path: str
    stream: bool
    facts: RequestFacts
    identity: AgentIdentity = ANONYMOUS
    # Who sent it, by its last message: a user, or the agent loop with a tool result.
    trigger: Trigger = Trigger.UNKNOWN
    # Unix time the router received the request, and its monotonic twin.
    received_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)
    # Written once, where the router decided; None if it never did (refused first).
    routed: Routed | None = None
    engine: str | None = None
    prefill_engine: str | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    prefill_cached_tokens: int | None = None
    status: int = 0
    # Set by whatever ends the request; None only while it runs.
    outcome: Outcome | None = None
    attempts: int = 0
    ttft_s: float | None = None
    # A stream's chunks after the first, and the seconds from the first to the last: all
    # that learning reads of the gaps between them, which a long stream would otherwise
    # hold a float each for while it lasts.
    decode_chunks: int = 0
    decode_s: float = 0.0
    # What the router counted on the chosen engine at the first chunk, for learning prices
    # (serve/prices.py): the prompt tokens in flight there and the unprefilled tokens ever
    # routed there.
    first_token_tokens: float = math.nan
    first_token_routed: float = math.nan
    duration_s: float = 0.0
    error: str | None = None


CompletionObserver = Callable[[Completion], None]


@dataclass(frozen=True)
class Reply:
    """An engine's reply as far as the router reads it before the client gets any of it:
    a stream's first chunk (after the prefill), or a whole body."""

    status: int
    content_type: str
    stream: bool
    data: bytes

    @property
    def took(self) -> bool:
        """The engine took the request and prefilled it: it now caches the prompt."""
        return self.status < 400


class Forwarder:
    """Runs attempts on the pool's engines and relays their replies to clients."""

    def __init__(
        self,
        pool: EnginePool,
        metrics: RouterMetrics,
        timeouts: Timeouts,
        retries: int = 2,
        pass_auth: bool = True,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.timeouts = timeouts
        self.retries = retries
        # The client headers an engine gets: its key too where the router has none.
        self.passed = (*_CLIENT_KEYS, *_PASSED_HEADERS) if pass_auth else _PASSED_HEADERS
        self.observers: list[CompletionObserver] = []

    def upstream_headers(self, received: Mapping[str, str]) -> dict[str, str]:
        """What of a client's headers (``serve``'s request, or those Envoy hands the
        picker) reaches an engine: the passed ones, and the client's key only when the
        router has none of its own."""
        lookup = received if isinstance(received, _CASE_INSENSITIVE) else CIMultiDict(received)
        # Uncompressed replies: the router reads them (errors, usage) and passes them on.
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        for name in self.passed:
            value = lookup.get(name)
            if value is not None:
                headers[name] = value
        return headers

    def tries(self, role: str, completion: Completion) -> Tries:
        """The tries of one request (or of one leg of a disaggregated one) on ``role``
        engines."""
        return Tries(self, role, completion)

    async def read_whole(self, attempt: Attempt) -> bytes:
        """A non-streamed reply's body. A 5xx is the engine's fault (raised); anything
        else, a 4xx included (the request's fault), clears the engine's failure record."""
        upstream = attempt.response
        assert upstream is not None
        body = await attempt.read_all()
        if upstream.status >= 500:
            raise EngineFault(f"answered {upstream.status}", status=upstream.status, body=body)
        self.pool.succeeded(attempt.engine)
        return body

    async def open(self, attempt: Attempt, completion: Completion) -> Reply:
        """The engine's reply up to where the client could get it: a stream's first chunk,
        anything else whole, so a body cut short becomes a clean error rather than a 200
        with half its JSON, and a stream that fails that early is still retried. Raises
        ``EngineFault`` (nothing has reached the client)."""
        engine, upstream = attempt.engine, attempt.response
        assert upstream is not None
        completion.engine = engine.url
        content_type = upstream.content_type
        stream = upstream.status < 400 and content_type == "text/event-stream"
        if stream:
            data = await attempt.read(self.timeouts.first_byte_s)
            completion.first_token_tokens = engine.total_inflight_tokens()
            completion.first_token_routed = engine.routed_unprefilled
            self.pool.succeeded(engine)
        else:
            data = await self.read_whole(attempt)
        reply = Reply(upstream.status, content_type, stream, data)
        if reply.took:
            completion.ttft_s = time.perf_counter() - completion.started
        return reply

    async def relay(
        self,
        request: web.Request,
        attempt: Attempt,
        reply: Reply,
        tags: dict[str, str],
        completion: Completion,
    ) -> web.StreamResponse:
        """The opened ``reply`` for the client, with ``tags`` as headers: the rest of a
        stream as it arrives, a whole body at once, the engine's own error in the API's
        shape."""
        completion.status = reply.status
        if reply.stream:
            return await self._relay(request, attempt, reply, tags, completion)
        if not reply.took:  # the request's fault: pass it on, in the API's shape
            response = dialect_for(completion.path).engine_error(reply.status, reply.data)
            response.headers.update(tags)
            completion.error = f"engine answered {reply.status}"
            completion.outcome = Outcome.ENGINE_ERROR
            return response
        usage = UsageTap.of(reply.data)
        completion.cached_tokens = self.count_cached(attempt.engine, usage)
        completion.output_tokens = usage.output_tokens()
        completion.outcome = Outcome.COMPLETED
        headers = {"Content-Type": reply.content_type or "application/json", **tags}
        return web.Response(body=reply.data, status=reply.status, headers=headers)

    async def _relay(
        self,
        request: web.Request,
        attempt: Attempt,
        reply: Reply,
        tags: dict[str, str],
        completion: Completion,
    ) -> web.StreamResponse:
        """Pass a stream on as the engine sends it. An engine fault ends it with an error
        event and no ``data: [DONE]``; a client that hung up ends it quietly, the engine
        blameless."""
        engine = attempt.engine
        headers = {"Content-Type": reply.content_type, **tags}
        response = web.StreamResponse(status=reply.status, headers=headers)
        if request.version >= (1, 1):  # an HTTP/1.0 client's body ends with the connection
            response.enable_chunked_encoding()
        chunks = 0
        first = last = time.perf_counter()
        usage = UsageTap.of(reply.data)
        try:
            await response.prepare(request)
            # The headers go with the first chunk, through aiohttp; the rest straight to
            # the client's transport as the engine sends it, framed as the response is.
            await attempt.deliver(response.write(reply.data))
            client = request.transport
            if client is None:
                raise ConnectionResetError("the client went away")
            chunked = response.chunked

            def write(chunk: bytes) -> None:
                nonlocal chunks, last
                if client.is_closing():
                    raise ConnectionResetError("the client went away")
                usage.feed(chunk)
                chunks, last = chunks + 1, time.perf_counter()
                if chunked:
                    client.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                else:
                    client.write(chunk)

            await attempt.pass_on(write, client, request.writer.drain)
            completion.decode_chunks, completion.decode_s = chunks, last - first
            # Before the client can see the end and ask again.
            completion.cached_tokens = self.count_cached(engine, usage)
            completion.output_tokens = usage.output_tokens()
            completion.outcome = Outcome.COMPLETED
            await response.write_eof()
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            completion.outcome = Outcome.CLIENT_GONE
            log.info(json.dumps({"event": "client_gone", "engine": engine.url}))
        except EngineFault as fault:
            self.pool.failed(engine, fault)
            completion.outcome = Outcome.CUT
            completion.error = str(fault)
            tail = b"".join(usage.chunks)
            event = dialect_for(completion.path).stream_event(
                502, f"the engine's stream broke off: {fault}", tail
            )
            with contextlib.suppress(ConnectionResetError):
                await response.write(event)
        return response

    def count_cached(self, engine: Engine, usage: UsageTap) -> int | None:
        """The cached prompt tokens the engine reported, counted in the metrics."""
        cached = usage.cached_tokens()
        if cached is not None:
            metrics = self.metrics
            metrics.child(metrics.reported, engine.url).inc(cached)
        return cached

    def completed(self, completion: Completion) -> None:
        """Tell every observer; none of them can fail the request or stop the others."""
        completion.duration_s = time.perf_counter() - completion.started
        for observer in self.observers:
            try:
                observer(completion)
            except Exception:
                log.exception("completion observer %r failed", observer)


class Tries:
    """One request's (or one leg's) tries on engines. While nothing has reached the
    client, an engine's failure (an ``EngineFault``) sends it to another engine, at most
    ``retries`` times once it may have run (a refused connection never ran it); then the
    last failure is the client's error. So a request may run more than once."""

    def __init__(self, forwarder: Forwarder, role: str, completion: Completion) -> None:
        self.forwarder = forwarder
        self.role = role
        self.completion = completion
        self.retries = forwarder.retries
        self.tried: set[str] = set()
        self.spent = False
        self.failure: web.Response | None = None  # the last engine's, once one failed

    def untried(self, engines: Sequence[Engine]) -> list[Engine]:
        """Those of ``engines`` (the healthy ones, read afresh before each try) to try
        next: none once the retries are spent."""
        return [] if self.spent else [e for e in engines if e.url not in self.tried]

    def on(self, engine: Engine, prompt_tokens: int, predicted: int) -> _Try:
        """An ``Attempt`` on ``engine`` for an ``async with`` block, predicted to hold
        ``predicted`` of the prompt's tokens. Its ``EngineFault`` is noted, not raised:
        the caller goes on to the next engine, or gives up."""
        forwarder, completion = self.forwarder, self.completion
        pool = forwarder.pool
        self.tried.add(engine.url)
        completion.attempts += 1
        unprefilled = prompt_tokens - predicted
        attempt = Attempt(
            engine,
            pool.engine_client(),
            forwarder.timeouts,
            prompt_tokens,
            unprefilled,
            auth=pool.auth(engine),
        )
        return _Try(self, attempt)

    def _failed(self, engine: Engine, fault: EngineFault) -> None:
        self.forwarder.pool.failed(engine, fault)
        role, dialect = self.role, dialect_for(self.completion.path)
        self.completion.error = f"{role} {engine.url}: {fault}"
        if fault.status is not None:
            self.failure = dialect.engine_error(fault.status, fault.body)
        else:  # unreachable 503, silent 504, broken 502 (as Envoy answers)
            status = 503 if fault.refused else 504 if fault.timeout else 502
            self.failure = dialect.response(status, f"{role} {engine.url} failed: {fault}")
        if not fault.refused:
            if self.retries == 0:
                self.spent = True
                return
            self.retries -= 1
        self.forwarder.metrics.retries.inc()

    def given_up(self) -> web.Response:
        """The client's error once no engine is left to try: the last engine's failure;
        a 503 refusal when there was none to try at all."""
        if self.failure is None:
            message = f"no healthy {self.role} to serve the request"
            raise Refusal(503, "no_healthy_engine", message)
        self.completion.outcome = Outcome.ENGINE_ERROR
        return self.failure


class _Try:
    """``Tries.on``'s block: its attempt, whose ``EngineFault`` is noted before the attempt
    ends (a class, not a generator, since every request makes one)."""

    def __init__(self, tries: Tries, attempt: Attempt) -> None:
        self.tries = tries
        self.attempt = attempt

    async def __aenter__(self) -> Attempt:
        return await self.attempt.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            if isinstance(exc, EngineFault):
                self.tries._failed(self.attempt.engine, exc)
                return True
            return False
        finally:
            await self.attempt.__aexit__(exc_type, exc, tb)


_decode = msgspec.json.Decoder().decode


class UsageTap:
    """Finds the cached prompt tokens an engine reports in a passing response: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``, the Responses API's
    ``usage.input_tokens_details.cached_tokens`` (a stream's under its final event's
    ``response``) or Anthropic's ``cache_read_input_tokens``.

    Only the last chunks are kept (at least ``KEEP`` bytes of them, since usage comes in
    the last JSON body or the last SSE chunks) and joined once at the end, so the work per
    chunk is proportional to the chunk, not to what is kept.
    """

    KEEP = 1 << 16

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.kept = 0
        self._parsed: list[dict] | None = None

    @classmethod
    def of(cls, body: bytes) -> UsageTap:
        """A tap that has seen a whole body."""
        tap = cls()
        tap.feed(body)
        return tap

    def feed(self, chunk: bytes) -> None:
        self._parsed = None
        self.chunks.append(chunk)
        self.kept += len(chunk)
        while self.kept - len(self.chunks[0]) >= self.KEEP:
            self.kept -= len(self.chunks.popleft())

    def cached_tokens(self) -> int | None:
        for usage in self._usages():
            details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
            cached = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
            if isinstance(cached, int):
                return cached
        return None

    def output_tokens(self) -> int | None:
        """OpenAI's ``completion_tokens`` or Anthropic's ``output_tokens``."""
        for usage in self._usages():
            tokens = usage.get("completion_tokens", usage.get("output_tokens"))
            if isinstance(tokens, int):
                return tokens
        return None

    def _usages(self) -> list[dict]:
        """The ``usage`` objects in the kept tail, last first; parsed once per tap."""
        if self._parsed is None:
            self._parsed = []
            lines = b"".join(self.chunks)[-self.KEEP :].replace(b"data: ", b"\n")
            # The lines that name a usage, found from the end rather than split out: a
            # stream's tail is hundreds of lines, of which one has it.
            end = len(lines)
            while (found := lines.rfind(b'"usage"', 0, end)) >= 0:
                end = lines.rfind(b"\n", 0, found) + 1
                stop = lines.find(b"\n", found)
                piece = lines[end : stop if stop >= 0 else len(lines)]
                try:
                    data = _decode(piece)
                    usage = data.get("usage") or (data.get("response") or {}).get("usage")
                except (msgspec.DecodeError, AttributeError):
                    continue
                if isinstance(usage, dict):
                    self._parsed.append(usage)
        return self._parsed
