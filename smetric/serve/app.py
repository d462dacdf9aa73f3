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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST

from smetric.core.blocks import ByteTokenizer, Tokenizer
from smetric.core.conversation import Api, ChatTemplate
from smetric.record.recorder import RecordedRequest, Recorder
from smetric.serve.analysis import Analyzer
from smetric.serve.auth import KeyCheck
from smetric.serve.buffered import ByteBudget, Hold
from smetric.serve.disagg import Disaggregation
from smetric.serve.discovery import Discovery
from smetric.serve.dispatch import Call, Colocated, Wiring
from smetric.serve.engine_client import EngineClient
from smetric.serve.engines import Engine
from smetric.serve.errors import answer_errors
from smetric.serve.forwarding import (
    Completion,
    CompletionObserver,
    Forwarder,
    Outcome,
)
from smetric.serve.global_tier import global_tier_from
from smetric.serve.intake import ROUTES, Intake
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.limits import inflated_bound
from smetric.serve.metrics import RouterMetrics, SubscriberCollector
from smetric.serve.outliers import OutlierDetector
from smetric.serve.pool import EnginePool
from smetric.serve.prices import PriceFeed
from smetric.serve.refusals import Refusal, RefusalLog
from smetric.serve.routing import RoutingCore
from smetric.serve.settings import RouterSettings
from smetric.serve.stored import STORED_PATH, forward, holder, not_found
from smetric.serve.token_count import COUNT_TOKENS_PATH, TokenCounter
from smetric.serve.upstream import Timeouts

__all__ = ["ROUTES", "Router", "RouterSettings"]


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
            engine_api_key=settings.engine_api_key,
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
            engine_tokenizer=self.engine_tokenizer,
        )
        self.intake = Intake(
            self.analyzer,
            self.metrics,
            settings.max_body_bytes,
            allow_client_transfer=settings.allow_client_kv_transfer_params,
        )
        self.refusals = RefusalLog(self.metrics.refused)
        self.buffered = ByteBudget(settings.max_buffered_bytes, report=self.metrics.buffered.set)
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
        self.token_counter = TokenCounter(self.intake, self.forwarder)
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

    def middlewares(self) -> list[Middleware]:
        """Any app fronting this router answers its refusals in the route's shape, counted
        and logged, and asks for a key on every path but its health checks (and
        ``/metrics`` with ``open_metrics``)."""
        open_paths = {"/health", "/live"} | ({"/metrics"} if self.settings.open_metrics else set())
        errors = answer_errors(self.refusals, self.settings.max_body_bytes)
        if not self.keys.wanted:  # every request is let in: no check to pass through
            return [errors]
        return [errors, self.keys.middleware(open_paths)]

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_body_bytes,
            middlewares=self.middlewares(),
            handler_args={"auto_decompress": False},  # see serve.limits.decoded_body
        )
        for path, api in ROUTES.items():
            app.router.add_post(path, self._handler(path, api))
        app.router.add_post(COUNT_TOKENS_PATH, self.count_tokens)
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
        # The router's own requests (checks, scrapes, lookups, stored responses). No cap
        # on connections (aiohttp's default is 100): a hidden queue in the router would
        # hold requests past their timeouts and blame healthy engines. No cookie jar: a
        # cookie an engine sets answers one request, and a jar would send it on every
        # later one to that engine, whoever sent it.
        client = aiohttp.ClientSession(
            timeout=timeout,
            auto_decompress=False,
            connector=aiohttp.TCPConnector(limit=0),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        # The requests it forwards (``serve/engine_client.py``).
        engine_client = EngineClient()
        await self.pool.start(client, engine_client)
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
        await engine_client.close()
        await client.close()

    # -- proxying ------------------------------------------------------------------------

    def _handler(self, path: str, api: Api) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            async with self.buffered.held(self._promised(request)) as hold:
                return await self.proxy(request, path, api, hold)

        return handle

    def _promised(self, request: web.Request) -> int:
        """The bytes held for a body before a byte of it is read: what its Content-Length
        promises, up to the per-request limit (past it, a 413 comes unread)."""
        return min(request.content_length or 0, self.settings.max_body_bytes)

    async def proxy(
        self, request: web.Request, path: str, api: Api, hold: Hold
    ) -> web.StreamResponse:
        """One generation request, from its bytes to its response's end, its body in
        ``hold``; a ``Refusal`` on the way in is answered by the ``answer_errors``
        middleware."""
        admitted = await self.intake.admit(path, request.headers, await self._read(request, hold))
        hold.shrink(len(admitted.raw))  # what is kept for a retry, inflated
        pinned, dispatcher = None, self.dispatcher
        previous = admitted.previous_response_id if api == "responses" else None
        if previous is not None:
            pinned = await self._holder(request, previous)
            if pinned is None:
                raise not_found(previous, "previous_response_id")
            dispatcher = Colocated(self.wiring)
        completion = Completion(
            api, path, admitted.stream, admitted.facts, admitted.identity, admitted.trigger
        )
        call = Call(request, admitted, completion, pinned)
        try:
            response = await dispatcher.dispatch(call)
            if completion.status == 0:  # answered before any engine did (none could)
                completion.status = response.status
            return response
        except Refusal as refusal:  # no engine could serve it
            completion.status = refusal.status
            completion.outcome = Outcome.ENGINE_ERROR
            raise
        except asyncio.CancelledError:
            completion.outcome = Outcome.CLIENT_GONE
            raise
        except Exception:  # the router's own fault: the client gets a 500
            completion.outcome = Outcome.ENGINE_ERROR
            raise
        finally:
            self.forwarder.completed(completion)
            latency = self.metrics.child(self.metrics.latency, api)
            latency.observe(completion.duration_s)

    async def _read(self, request: web.Request, hold: Hold) -> bytes:
        """The body as sent, ``hold`` grown as it arrives: one over the limit is refused
        unread when its Content-Length says so, so it costs nothing, else as soon as it
        passes the limit; one that takes longer than ``body_timeout_s`` to arrive is cut
        off. A compressed body then holds the most it may inflate to."""
        check = self.intake.check_size
        check(request.content_length or 0)
        deadline = self.settings.body_timeout_s
        content = request.content
        pieces: list[bytes] = []
        size = 0
        try:
            # A body that came whole with its headers has no wait to bound.
            waiting = contextlib.nullcontext() if content.is_eof() else asyncio.timeout(deadline)
            async with waiting:
                while not content.at_eof():
                    piece = await content.readany()
                    size += len(piece)
                    check(size)
                    await hold.grow(size)
                    pieces.append(piece)
        except TimeoutError:
            message = f"request body not received within {deadline:g} s"
            raise Refusal(408, "body_timeout", message) from None
        if request.headers.get("Content-Encoding"):
            await hold.grow(inflated_bound(size, self.settings.max_body_bytes))
        return b"".join(pieces)

    async def count_tokens(self, request: web.Request) -> web.Response:
        async with self.buffered.held(self._promised(request)) as hold:
            return await self.token_counter.answer(request, await self._read(request, hold))

    async def _holder(self, request: web.Request, response_id: str) -> Engine | None:
        headers = self.forwarder.upstream_headers(request.headers)
        timeout = self.settings.stream_headers_timeout_s
        return await holder(self.pool, self.pool.healthy(), response_id, headers, timeout)

    async def stored_response(self, request: web.Request) -> web.Response:
        """``GET`` or ``DELETE /v1/responses/{id}``, on the engine that holds it."""
        response_id = request.match_info["id"]
        engine = await self._holder(request, response_id)
        if engine is None:
            raise not_found(response_id)
        headers = self.forwarder.upstream_headers(request.headers)
        return await forward(self.pool, engine, request, headers, self.settings.idle_timeout_s)

    def record(self, completion: Completion) -> None:
        """Queue a request an engine served (the client hanging up included) for the
        recorder; a disaggregated one under its prefill engine, where its prompt is."""
        assert self.recorder is not None
        engine = completion.prefill_engine or completion.engine
        if engine is None or not 200 <= completion.status < 400:
            return
        facts, identity = completion.facts, completion.identity
        self.recorder.observe(
            RecordedRequest(
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
                branch=completion.routed.branch if completion.routed else "",
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
