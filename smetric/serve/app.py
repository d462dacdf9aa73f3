"""``smetric serve``: an OpenAI-compatible router running the policies of ``smetric.core``.

This module is wiring only. The parts, each behind a small interface:

- ``serve.pool.EnginePool``: the engines, their health, scrapes, ejection and stalls;
- ``serve.analysis.Analyzer``: a body into ``RequestFacts`` (turn, expected hit, blocks;
  no session table), off the event loop when large;
- ``serve.routing.RoutingCore``: the view, the policy's decision, its explanation; pure of
  HTTP, shared with other front doors;
- ``serve.forwarding.Forwarder``: attempts, retries, relay, usage, and the completion
  observers (``Router.observers``);
- ``serve.dispatch.Dispatcher``: ``Colocated``, or ``serve.disagg.Disaggregation``;
- ``serve.stored``: the engine holding a stored Responses API response, which a
  ``previous_response_id`` follow-up and ``GET``/``DELETE /v1/responses/{id}`` go to;
- ``record.Recorder``, where one is given: a completion observer writing a trace of the
  requests served (``serve --record``).

A request counts as in flight from the moment it is routed until its response ends, fails
or the client goes away (``serve.upstream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST

from smetric.core.blocks import ByteTokenizer, Tokenizer
from smetric.core.conversation import Api, ChatTemplate, RequestError
from smetric.core.parsing import decode_body
from smetric.core.policies import DEFAULT_POLICY, POLICY_NAMES
from smetric.core.settings import check_settings, setting
from smetric.record.recorder import Observation, Recorder
from smetric.record.trigger import body_trigger
from smetric.serve.analysis import OFF_LOOP_BYTES, Analyzer
from smetric.serve.auth import KeyCheck
from smetric.serve.backends import without_client_transfer
from smetric.serve.disagg import Disaggregation
from smetric.serve.discovery import Discovery
from smetric.serve.dispatch import Call, Colocated, Wiring
from smetric.serve.engines import Engine
from smetric.serve.errors import error_response, errors_as_json
from smetric.serve.forwarding import Completion, CompletionObserver, Forwarder, is_stream
from smetric.serve.global_tier import GLOBAL_TIERS, global_tier_from
from smetric.serve.identity import identity_of
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.limits import BodyError, decoded_body
from smetric.serve.metrics import RouterMetrics, SubscriberCollector
from smetric.serve.outliers import OutlierDetector
from smetric.serve.pool import EnginePool
from smetric.serve.prices import PriceFeed
from smetric.serve.routing import RoutingCore
from smetric.serve.stored import STORED_PATH, forward, holder, not_found, previous_id
from smetric.serve.upstream import Timeouts

__all__ = ["ROUTES", "Router", "RouterSettings"]

ROUTES: dict[str, Api] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}


@dataclass
class RouterSettings:
    """How the router routes, checks engines and guards itself: what the ``router:``
    section of ``smetric serve --config`` and the flags of the same names set."""

    policy: str = setting(
        DEFAULT_POLICY,
        f"Routing policy: {', '.join(POLICY_NAMES)}, or NAME:key=value,... with its parameters.",
    )
    block_size: int = setting(16, "Tokens per KV block (the engines' block size).", ge=1)
    api_keys: frozenset[str] = setting(
        frozenset(),
        "Accepted client keys (a flag per key); with any, every route but /health needs one, "
        "as 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
        # An empty key (``--api-key "$KEY"`` with KEY unset) would admit an empty header.
        nonempty_items=True,
    )
    open_metrics: bool = setting(False, "Let /metrics answer without a key (scrapers).")
    allow_client_kv_transfer_params: bool = setting(
        False,
        "Pass clients' kv_transfer_params on to engines; else they are dropped, since "
        "they name the address an engine reads or sends KV to.",
    )
    health_interval_s: float = setting(2.0, "Seconds between health checks.", ge=0.05)
    max_body_bytes: int = setting(32 << 20, "Largest request body, in bytes.", ge=1)
    body_timeout_s: float = setting(
        60.0,
        "Seconds a client has to send a request's whole body; then it gets a 408 and the "
        "connection closes, so a body trickled a byte at a time holds nothing for long.",
        gt=0,
    )
    max_prompt_tokens: int = setting(
        0,
        "Longest prompt analysed, in tokens; longer ones get a 400 before they are "
        "tokenised (0: the largest max_model_len the engines' /v1/models report).",
        ge=0,
    )
    analysis_threads: int = setting(
        2,
        "Large prompts analysed at once in worker threads, each holding its tokens "
        "meanwhile (0: on the event loop).",
        ge=0,
    )
    connect_timeout_s: float = setting(
        Timeouts.connect_s, "Seconds to wait for a connection to an engine.", gt=0
    )
    first_byte_timeout_s: float = setting(
        Timeouts.first_byte_s,
        "Seconds to wait for an engine's response headers (a non-streaming reply's come at "
        "its end, a disaggregated prefill's too) or a stream's first chunk; then the "
        "request is retried elsewhere.",
        gt=0,
    )
    idle_timeout_s: float = setting(
        Timeouts.idle_s, "Seconds an engine may go silent mid-response before it is cut off.", gt=0
    )
    stream_headers_timeout_s: float = setting(
        Timeouts.stream_headers_s,
        "Seconds to wait for a streaming reply's headers, which engines send as soon as "
        "they take the request; then it is retried elsewhere.",
        gt=0,
    )
    stall_timeout_s: float = setting(
        20.0,
        "Seconds an engine with requests in flight may show no progress (no byte of any "
        "response, no prompt or generation counter moved in its /metrics) before it is "
        "ejected as stalled and its requests that sent the client nothing are retried "
        "elsewhere (0: never); prompts still to prefill add a second per stall_prefill_tps "
        "tokens.",
        ge=0,
    )
    # The default is below the slowest long prefills the performance model puts on its
    # presets: a fresh 129 k-token prompt of Qwen3-30B-A3B on one H20 at about 2,200
    # tokens/s (58 s), of Qwen3-235B-A22B-FP8 on four at about 1,700 (76 s).
    stall_prefill_tps: float = setting(
        1000.0,
        "Prompt tokens routed to an engine and not yet prefilled that earn it one more "
        "second before a stall: a prefill sends nothing and moves no counter until its "
        "first token.",
        gt=0,
    )
    retries: int = setting(
        2,
        "Other engines to try for a request (disaggregated: for each leg) that failed "
        "before the client got any byte (refused connections do not count).",
        ge=0,
    )
    eject_after: int = setting(
        3,
        "Failed requests (5xx, garbage, timeouts) in a row that eject an engine, for a "
        "backoff that doubles with each ejection until a request succeeds there again.",
        ge=1,
    )
    eject_backoff_s: float = setting(5.0, "Seconds of an engine's first ejection.", ge=0)
    eject_backoff_max_s: float = setting(
        300.0, "Longest ejection, in seconds, however often an engine fails.", ge=0
    )
    scrape_interval_s: float = setting(
        0.0,
        "Seconds between scrapes of engines' /metrics (0: off); running + waiting then "
        "raise the load, and cache_config_info sizes the prefix index. Busy engines are "
        "scraped for their progress anyway (see stall_timeout_s).",
        ge=0,
    )
    staleness_s: float = setting(5.0, "Ignore a scrape older than this many seconds.", ge=0)
    memo_bytes: int = setting(
        256 << 20, "Bytes the memo of rendered, tokenised and hashed message prefixes holds.", ge=0
    )
    global_tier: str = setting(
        "none",
        "What the router knows of the cluster's global KV tier (what a session moved to "
        "another engine loads instead of recomputing): none (unknown), events (the blocks "
        "engines with kv_events report on a CPU or storage medium, as vLLM's CPU offloading "
        "and LMCache do, taken as one shared store) or full (a store without events that "
        "keeps every prompt the engines prefilled).",
        choices=GLOBAL_TIERS,
    )
    global_tier_tokens: int = setting(
        0,
        "Capacity of the full global tier in tokens, least recently used out first (0: unbounded).",
        ge=0,
    )
    drain_timeout_s: float = setting(
        30.0,
        "On SIGTERM, stop accepting at once and give the requests in flight this many "
        "seconds to finish before they are cut.",
        ge=0,
    )

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass
class Router:
    engines: list[Engine]
    settings: RouterSettings = field(default_factory=RouterSettings)
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    # The model's chat template, so prompts are cut into the blocks the engine caches.
    template: ChatTemplate | None = None
    # Tokenise with an engine's tokenize endpoint instead (exact for any model, a round trip).
    engine_tokenizer: bool = False
    # KV-event subscribers of the engines that have an events view, by engine URL.
    subscribers: dict[str, KVEventSubscriber] = field(default_factory=dict)
    # Prefill and decode roles of the engines, when they serve disaggregated (disagg.py).
    disagg: Disaggregation | None = None
    # Engines that join and leave as DNS says (serve.discovery), beside those listed.
    discovery: Discovery | None = None
    # Writes a trace of the requests served (``smetric.record``).
    recorder: Recorder | None = None

    def __post_init__(self) -> None:
        settings = self.settings
        self.core = RoutingCore(
            settings.policy,
            settings.block_size,
            settings.staleness_s,
            global_tier_from(
                settings.global_tier,
                settings.global_tier_tokens,
                settings.block_size,
                self.engines,
            ),
            # Disaggregated, the policy places prefills: on unprefilled tokens (Figure 13,
            # line 29).
            load="inflight_requests" if self.disagg is None else "unprefilled_tokens",
        )
        self.metrics = RouterMetrics(self.core.policy.name, [])
        self.pool = EnginePool(
            self.engines,
            self.metrics,
            block_size=settings.block_size,
            health_interval_s=settings.health_interval_s,
            connect_timeout_s=settings.connect_timeout_s,
            scrape_interval_s=settings.scrape_interval_s,
            staleness_s=settings.staleness_s,
            stall_timeout_s=settings.stall_timeout_s,
            stall_prefill_tps=settings.stall_prefill_tps,
            outliers=OutlierDetector(
                settings.eject_after, settings.eject_backoff_s, settings.eject_backoff_max_s
            ),
            subscribers=self.subscribers,
        )
        # The pool's own list, so engines added at runtime are the router's too.
        self.engines = self.pool.engines
        self.subscribers = self.pool.subscribers
        self.metrics.register(SubscriberCollector(self.subscribers))
        self.analyzer = Analyzer(
            self.pool,
            self.tokenizer,
            self.template,
            block_size=settings.block_size,
            memo_bytes=settings.memo_bytes,
            threads=settings.analysis_threads,
            max_prompt_tokens=settings.max_prompt_tokens,
            max_body_bytes=settings.max_body_bytes,
            engine_tokenizer=self.engine_tokenizer,
        )
        timeouts = Timeouts(
            settings.connect_timeout_s,
            settings.first_byte_timeout_s,
            settings.idle_timeout_s,
            settings.stream_headers_timeout_s,
        )
        self.keys = KeyCheck(settings.api_keys)
        self.forwarder = Forwarder(
            self.pool, self.metrics, timeouts, settings.retries, not settings.api_keys
        )
        # A policy that prices work learns its prices from the engines' replies.
        self.prices = PriceFeed(self.core.policy, settings.policy, self.metrics.learned_price)
        if self.prices.learning:
            self.observers.append(self.prices.observer(self.pool.get))
        self.wiring = Wiring(self.pool, self.core, self.forwarder, self.metrics)
        self.dispatcher = (
            Colocated(self.wiring) if self.disagg is None else self.disagg.attach(self.wiring)
        )
        if self.recorder is not None:
            self.observers.append(self.record)

    @property
    def observers(self) -> list[CompletionObserver]:
        """Called with each dispatched request's ``Completion`` once it has ended."""
        return self.forwarder.observers

    # -- application --------------------------------------------------------------------

    def key_check(self) -> Middleware:
        """Any app fronting this router asks for a key on every path but its health
        checks (and ``/metrics`` with ``open_metrics``)."""
        open_paths = {"/health", "/live"} | ({"/metrics"} if self.settings.open_metrics else set())
        return self.keys.middleware(open_paths)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_body_bytes,
            middlewares=[errors_as_json, self.key_check()],
            handler_args={"auto_decompress": False},  # see serve.limits.decoded_body
        )
        for path, api in ROUTES.items():
            app.router.add_post(path, self._handler(path, api))
        app.router.add_get(STORED_PATH, self.stored_response)
        app.router.add_delete(STORED_PATH, self.stored_response)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", alive)
        app.router.add_get("/metrics", self.prometheus)
        app.cleanup_ctx.append(self.lifecycle)
        return app

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """The cleanup context of any app that fronts this router: the engines' checks,
        scrapes and KV-event subscriptions run while it does."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s)
        # No cap on connections (aiohttp's default is 100): a hidden queue in the router
        # would hold requests past their first-byte timeout and blame healthy engines.
        client = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)
        )
        await self.pool.start(client)
        if self.recorder is not None:
            self.recorder.start()  # here, so that each forked worker runs its own writer
        async with contextlib.AsyncExitStack() as stack:
            if self.discovery is not None:
                failed = self.metrics.discovery_errors.inc
                await stack.enter_async_context(self.discovery.kept(self.pool, failed))
            yield
        await self.pool.close()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)
        await client.close()

    # -- proxying ------------------------------------------------------------------------

    def _handler(self, path: str, api: Api) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.proxy(request, path, api)

        return handle

    async def proxy(self, request: web.Request, path: str, api: Api) -> web.StreamResponse:
        try:
            raw = await self._read_body(request)
        except BodyError as exc:
            refusal = error_response(exc.status, str(exc))
            if exc.status == 408 and request.transport is not None:
                # Nor is the rest of so slow a body waited for (aiohttp would linger,
                # reading it, 10 s more): the answer goes, and the connection with it.
                await refusal.prepare(request)
                await refusal.write_eof()
                request.transport.close()
            return refusal
        try:
            body = decode_body(raw)
        except RequestError as exc:
            return error_response(400, str(exc))
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object")
        if not self.settings.allow_client_kv_transfer_params:
            raw, body = without_client_transfer(raw, body)
        try:
            facts = await self.analyzer.analyze(body, api, large=len(raw) > OFF_LOOP_BYTES)
        except RequestError as exc:
            return error_response(400, str(exc))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return error_response(502, f"tokenising with the engine failed: {exc}")
        identity = identity_of(request.headers, body)
        self.metrics.agent_requests.labels(
            identity.harness or "none", identity.role, identity.call(facts.turn)
        ).inc()
        pinned, dispatcher = None, self.dispatcher
        if api == "responses" and (previous := previous_id(body)) is not None:
            pinned = await self._holder(request, previous)
            if pinned is None:
                return not_found(previous, "previous_response_id")
            dispatcher = Colocated(self.wiring)
        completion = Completion(api, path, is_stream(body), facts, identity)
        completion.trigger = body_trigger(body)
        call = Call(request, path, raw, body, facts, completion, pinned)
        try:
            response = await dispatcher.dispatch(call)
            if completion.status == 0:  # answered before any engine did (none could)
                completion.status = response.status
            return response
        except asyncio.CancelledError:
            completion.outcome = "client_gone"
            raise
        finally:
            self.metrics.latency.labels(api).observe(time.perf_counter() - completion.started)
            self.forwarder.completed(completion)

    async def _holder(self, request: web.Request, response_id: str) -> Engine | None:
        headers = self.forwarder.upstream_headers(request)
        timeout = self.settings.stream_headers_timeout_s
        return await holder(self.pool, self.pool.healthy(), response_id, headers, timeout)

    async def stored_response(self, request: web.Request) -> web.Response:
        """``GET`` or ``DELETE /v1/responses/{id}``, on the engine that holds it."""
        response_id = request.match_info["id"]
        engine = await self._holder(request, response_id)
        if engine is None:
            return not_found(response_id)
        headers = self.forwarder.upstream_headers(request)
        return await forward(self.pool, engine, request, headers, self.settings.idle_timeout_s)

    async def _read_body(self, request: web.Request) -> bytes:
        """The body, inflated; one over the analyzer's ``body_limit()`` is refused unread
        when its Content-Length says so, so it costs nothing, and one that takes longer
        than ``body_timeout_s`` to arrive is cut off."""
        limit = self.analyzer.body_limit()
        if (request.content_length or 0) > limit:
            raise BodyError(413, f"request body too large: over {limit} bytes")
        encoding = request.headers.get("Content-Encoding", "")
        deadline = self.settings.body_timeout_s
        try:
            async with asyncio.timeout(deadline):
                raw = await request.read()
        except TimeoutError:
            raise BodyError(408, f"request body not received within {deadline:g} s") from None
        return decoded_body(raw, encoding, limit)

    def record(self, completion: Completion) -> None:
        """Queue a request an engine served (the client hanging up included) for the
        recorder; a disaggregated one under its prefill engine, where its prompt is."""
        assert self.recorder is not None
        engine = completion.prefill_engine or completion.engine
        if engine is None or not 200 <= completion.status < 400:
            return
        facts, identity = completion.facts, completion.identity
        self.recorder.observe(
            Observation(
                arrival_s=completion.received_at,
                completion_s=completion.received_at + completion.duration_s,
                blocks=facts.blocks,
                prompt_tokens=facts.prompt_tokens,
                output_tokens=completion.output_tokens,
                cached_tokens=(
                    completion.cached_tokens
                    if completion.prefill_engine is None
                    else completion.prefill_cached_tokens
                ),
                turn=facts.turn,
                conversation=facts.session_key,
                engine=engine,
                branch=completion.branch or "",
                trigger=completion.trigger,
                session=identity.session,
                agent=identity.agent,
                parent_agent=identity.parent,
            )
        )

    # -- small endpoints -----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 while every role (colocated: engine; disaggregated: prefill and decode) has
        a healthy engine, else 503: a load balancer must not send what cannot be served."""
        roles = self.dispatcher.roles()
        ready = all(roles.values())
        return web.json_response(
            {
                "status": "ok" if ready else "unavailable",
                "healthy_engines": sum(e.healthy for e in self.engines),
                "roles": roles,
            },
            status=200 if ready else 503,
        )

    async def models(self, request: web.Request) -> web.Response:
        """The union of the healthy engines' models, asked all at once."""
        listed = await asyncio.gather(*(self.pool.list_models(e) for e in self.pool.healthy()))
        seen: dict[str, dict] = {}
        for model in (m for models in listed for m in models):
            seen.setdefault(model["id"], model)
        return web.json_response({"object": "list", "data": list(seen.values())})

    async def prometheus(self, request: web.Request) -> web.Response:
        body = self.metrics.exposition(self.engines)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def alive(request: web.Request) -> web.Response:
    """Liveness, apart from readiness (``/health``): the process answers, engines or not,
    so a router without engines is taken out of rotation but not restarted."""
    return web.json_response({"status": "alive"})
