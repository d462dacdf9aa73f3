"""``smetric serve``: an OpenAI-compatible router running the policies of ``smetric.core``.

Each request is analysed from its body alone (turn, expected hit, prompt blocks; no session
table), the policy picks an engine from the view the simulator also builds (local prefix
hit per engine from the router's own index or the engines' KV events, in-flight requests,
their prompt tokens and unprefilled tokens as load, and, where configured, what the
global tier holds of the prompt: ``serve.global_tier``), and the response
streams back chunk by chunk as the engine sends it. A request counts as in flight from the
moment it is routed until its response ends, fails or the client goes away
(``serve.upstream``).

A request that fails before any byte reached the client (the engine refused, stalled,
answered 5xx or garbage) is retried on another engine, so it may run more than once
(at-least-once); once the client has bytes, a failure ends the response with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import ByteTokenizer, Tokenizer, reusable_hit_tokens
from smetric.core.conversation import (
    Api,
    ChatTemplate,
    RequestError,
    RequestFacts,
    analyze_request,
)
from smetric.core.parsing import decode_body
from smetric.core.policies import DEFAULT_POLICY, ClusterView, make_policy
from smetric.serve.auth import require_key
from smetric.serve.engines import Engine
from smetric.serve.errors import engine_error, error_body, error_response, errors_as_json
from smetric.serve.global_tier import global_tier_from
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.limits import BYTES_PER_TOKEN, BodyError, CappedTokenizer, decoded_body
from smetric.serve.metrics import RouterMetrics, SubscriberCollector
from smetric.serve.outliers import OutlierDetector
from smetric.serve.scrape import parse_vllm_metrics
from smetric.serve.tokenizers import EngineTokens, analyze_with_engine
from smetric.serve.upstream import Attempt, EngineFault, Timeouts

if TYPE_CHECKING:
    from smetric.serve.disagg import Disaggregation

log = logging.getLogger("smetric.serve")

ENGINE_HEADER = "x-smetric-engine"
# What the router expected the engine to find cached, so a client can set it beside the
# engine's own ``cached_tokens`` request by request.
PREDICTED_HIT_HEADER = "x-smetric-predicted-hit-tokens"
# Bodies above this are analysed off the event loop.
_OFF_LOOP_BYTES = 64 << 10
# What a try's ``send`` hands back: the client's response, or a disaggregated leg's result.
Sent = TypeVar("Sent")
_ROUTES: dict[str, Api] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
}


@dataclass
class RouterSettings:
    policy: str = DEFAULT_POLICY
    block_size: int = 16
    api_keys: frozenset[str] = frozenset()
    # Let scrapers read /metrics without a key (every other route but /health needs one).
    open_metrics: bool = False
    health_interval_s: float = 2.0
    max_body_bytes: int = 32 << 20
    # Longest prompt, in tokens, the router analyses; 0: the largest max_model_len the
    # engines' /v1/models report, once one does.
    max_prompt_tokens: int = 0
    # Large prompts analysed at once in worker threads (each holds its tokens meanwhile).
    analysis_threads: int = 2
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = Timeouts.first_byte_s
    idle_timeout_s: float = Timeouts.idle_s
    # Tries on other engines for a request that failed before the client got any byte.
    retries: int = 2
    # Passive health: this many failed requests in a row eject an engine, for a backoff
    # that doubles with each ejection until a request succeeds there again.
    eject_after: int = 3
    eject_backoff_s: float = 5.0
    eject_backoff_max_s: float = 300.0
    # Scrape engines' /metrics this often (0: never) and trust a scrape this long.
    scrape_interval_s: float = 0.0
    staleness_s: float = 5.0
    # Bound of the memo of rendered, tokenised and hashed message prefixes.
    memo_bytes: int = 256 << 20
    # Where global_hit_tokens comes from: none (unknown), events (engines' offload media)
    # or full (every prompt served, within global_tier_tokens if set); serve.global_tier.
    global_tier: str = "none"
    global_tier_tokens: int = 0


@dataclass(frozen=True)
class Delivery:
    """What the router adds to an engine's reply (``tags``, as headers) and records once it
    is served: ``facts``, the prompt the engine prefilled, with the hit ``predicted``
    there (None for a disaggregated decode, whose prompt was prefilled elsewhere)."""

    tags: dict[str, str]
    facts: RequestFacts | None = None
    predicted: int = 0


@dataclass
class Router:
    engines: list[Engine]
    settings: RouterSettings = field(default_factory=RouterSettings)
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    # The model's chat template, so prompts are cut into the blocks the engine caches.
    template: ChatTemplate | None = None
    # Tokenise with an engine's /tokenize instead (exact for any model, one round trip).
    engine_tokenizer: bool = False
    # KV-event subscribers of the engines that have an events view, by engine URL.
    subscribers: dict[str, KVEventSubscriber] = field(default_factory=dict)
    # Prefill and decode roles of the engines, when they serve disaggregated (disagg.py).
    disagg: Disaggregation | None = None

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("the router needs at least one engine")
        self.policy = make_policy(self.settings.policy)
        self.metrics = RouterMetrics(self.policy.name, [e.url for e in self.engines])
        self.metrics.registry.register(SubscriberCollector(self.subscribers))
        self.client: aiohttp.ClientSession | None = None
        if self.disagg is not None:
            self.disagg.register(self)
        settings = self.settings
        self.timeouts = Timeouts(
            settings.connect_timeout_s, settings.first_byte_timeout_s, settings.idle_timeout_s
        )
        self.outliers = OutlierDetector(
            settings.eject_after, settings.eject_backoff_s, settings.eject_backoff_max_s
        )
        self._analysis_slots = asyncio.Semaphore(settings.analysis_threads)
        # The longest context each engine's /v1/models reported (0: it reports none).
        self.context_lengths: dict[str, int] = {}
        # A message too long for any engine is refused before it is tokenised.
        self.tokenizer = CappedTokenizer(self.tokenizer, self.max_prompt_tokens)
        # Follow-ups re-send earlier turns: their blocks are looked up, not recomputed.
        memo_tokenizer = EngineTokens() if self.engine_tokenizer else self.tokenizer
        self.memo = BlockMemo(memo_tokenizer, self.settings.block_size, self.settings.memo_bytes)
        # Each engine's number in the configuration, stable while others come and go.
        self._numbers = {e.url: i for i, e in enumerate(self.engines)}
        self.global_tier = global_tier_from(
            settings.global_tier, settings.global_tier_tokens, settings.block_size, self.engines
        )

    # -- application --------------------------------------------------------------------

    def app(self) -> web.Application:
        open_paths = {"/health", "/metrics"} if self.settings.open_metrics else {"/health"}
        app = web.Application(
            client_max_size=self.settings.max_body_bytes,
            middlewares=[errors_as_json, require_key(self.settings.api_keys, open_paths)],
            handler_args={"auto_decompress": False},  # see serve.limits.decoded_body
        )
        for path, api in _ROUTES.items():
            app.router.add_post(path, self._handler(path, api))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout_s)
        # No cap on connections (aiohttp's default is 100): a hidden queue in the router
        # would hold requests past their first-byte timeout and blame healthy engines.
        self.client = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)
        )
        for subscriber in self.subscribers.values():
            await subscriber.start()
        tasks = [asyncio.create_task(self._check_health_forever())]
        if self.settings.scrape_interval_s > 0:
            tasks.append(asyncio.create_task(self._scrape_forever()))
        # One scrape of each engine before serving, scraping on or not: it sizes the index
        # to the engine's KV pool before anything is routed there, and the start time it
        # reports is what a re-admission compares with to tell a restart from a blip.
        await asyncio.gather(*(self.scrape(e) for e in self.engines))
        yield
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks)
        for subscriber in self.subscribers.values():
            await subscriber.close()
        await self.client.close()

    # -- proxying ------------------------------------------------------------------------

    def _handler(self, path: str, api: Api) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.proxy(request, path, api)

        return handle

    async def proxy(self, request: web.Request, path: str, api: Api) -> web.StreamResponse:
        try:
            raw = await self._read_body(request)
        except BodyError as exc:
            return error_response(exc.status, str(exc))
        try:
            body = decode_body(raw)
        except RequestError as exc:
            return error_response(400, str(exc))
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object")
        try:
            facts = await self.analyze(body, api, large=len(raw) > _OFF_LOOP_BYTES)
        except RequestError as exc:
            return error_response(400, str(exc))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return error_response(502, f"tokenising with the engine failed: {exc}")
        started = time.perf_counter()
        try:
            if self.disagg is not None:
                return await self.disagg.serve(self, request, path, body, facts)
            return await self._forward(request, path, raw, facts)
        finally:
            self.metrics.latency.labels(api).observe(time.perf_counter() - started)

    async def _read_body(self, request: web.Request) -> bytes:
        """The body, inflated; one over ``body_limit()`` is refused unread when its
        Content-Length says so, so it costs nothing."""
        limit = self.body_limit()
        if (request.content_length or 0) > limit:
            raise BodyError(413, f"request body too large: over {limit} bytes")
        encoding = request.headers.get("Content-Encoding", "")
        return decoded_body(await request.read(), encoding, limit)

    async def analyze(self, body: dict, api: Api, large: bool = False) -> RequestFacts:
        """Facts for routing. A large body is analysed in a worker thread: a follow-up costs
        about a millisecond there (the memo holds its history), but a new 128 k-token prompt
        takes a few ms with the byte tokenizer and far more with a model's, which releases
        the GIL while it encodes, so other requests keep streaming meanwhile; a few at a
        time, since each holds its tokens meanwhile."""
        bs = self.settings.block_size
        if not self.engine_tokenizer:
            args = (body, api, self.tokenizer, bs, self.template, self.memo)
            if large:
                async with self._analysis_slots:
                    return await asyncio.to_thread(analyze_request, *args)
            return analyze_request(*args)
        assert self.client is not None
        engine = next((e for e in self.engines if e.healthy), self.engines[0])
        # A router switched to engine tokenisation after it was made has no memo for it.
        memo = self.memo if isinstance(self.memo.tokenizer, EngineTokens) else None
        return await analyze_with_engine(
            body, api, self.client, engine.url, bs, self.template, memo
        )

    def max_prompt_tokens(self) -> int:
        """The configured cap, else the longest context an engine reported (0: none yet)."""
        return self.settings.max_prompt_tokens or max(self.context_lengths.values(), default=0)

    def body_limit(self) -> int:
        """Bytes a body may have: the configured limit, lowered to what the longest prompt
        the engines take could need."""
        tokens = self.max_prompt_tokens()
        limit = self.settings.max_body_bytes
        return limit if tokens == 0 else min(limit, tokens * BYTES_PER_TOKEN)

    def route(
        self, facts: RequestFacts, engines: list[Engine], loads: list[float] | None = None
    ) -> tuple[Engine, int]:
        """The policy's pick among ``engines`` and its predicted hit; ``loads`` replaces
        the in-flight requests as load (disaggregated prefills: unprefilled tokens).

        The predicted hit is the better of the engine's local hit and the global tier's,
        as the simulator's instance counts a queued request's unprefilled tokens and as
        vLLM reports ``cached_tokens`` (tokens a KV connector loads count as cached)."""
        bs = self.settings.block_size
        hits = [e.predicted_hit(facts.blocks, bs, facts.prompt_tokens) for e in engines]
        if loads is None:
            now = time.monotonic()
            loads = [e.load(now, self.settings.staleness_s) for e in engines]
        tier = self.global_tier
        global_hit = (
            None
            if tier is None
            else reusable_hit_tokens(tier.match(facts.blocks), facts.prompt_tokens, bs)
        )
        view = ClusterView(
            hit_tokens=hits,
            load=loads,
            prefill_tokens=[float(e.total_unprefilled()) for e in engines],
            instance_ids=[self._numbers[e.url] for e in engines],
            token_load=[float(e.total_inflight_tokens()) for e in engines],
            global_hit_tokens=global_hit,
        )
        decision = self.policy.route(facts.routing_request(), view)
        engine = engines[decision.instance]
        predicted = hits[decision.instance]
        if global_hit is not None:
            predicted = max(predicted, global_hit)
        self.metrics.decisions.labels(decision.branch).inc()
        if log.isEnabledFor(logging.INFO):  # the line costs more than the decision
            log.info(
                json.dumps(
                    {
                        "event": "route",
                        "engine": engine.url,
                        "branch": decision.branch,
                        "turn": facts.turn,
                        "prompt_tokens": facts.prompt_tokens,
                        "est_hit_tokens": facts.est_hit_tokens,
                        "predicted_hit_tokens": predicted,
                        "hit_tokens": hits,
                        "global_hit_tokens": global_hit,
                        "loads": loads,
                        "token_loads": view.token_load,
                        "prefill_tokens": view.prefill_tokens,
                    }
                )
            )
        return engine, predicted

    async def _forward(
        self, request: web.Request, path: str, raw: bytes, facts: RequestFacts
    ) -> web.StreamResponse:
        headers = self.upstream_headers(request)

        async def send(attempt: Attempt, predicted: int) -> web.StreamResponse:
            await attempt.send(path, raw, headers)
            tags = {ENGINE_HEADER: attempt.engine.url, PREDICTED_HIT_HEADER: str(predicted)}
            return await self.answer(request, attempt, Delivery(tags, facts, predicted))

        return await self.try_engines(
            "engine", self.engines, lambda c: self.route(facts, c), facts.prompt_tokens, send
        )

    async def try_engines(
        self,
        role: str,
        pool: list[Engine],
        choose: Callable[[list[Engine]], tuple[Engine, int]],
        prompt_tokens: int,
        send: Callable[[Attempt, int], Awaitable[Sent]],
    ) -> Sent | web.Response:
        """One request (or one leg of a disaggregated one) on the healthy engines of
        ``pool``: ``choose`` picks one and the prompt tokens it is predicted to hold, and
        ``send`` runs an ``Attempt`` there. While nothing has reached the client (``send``
        raises ``EngineFault`` only then), an engine's failure sends it to another, at
        most ``retries`` times once it may have run (a refused connection never ran it);
        then the last failure is the client's error."""
        retries = self.settings.retries
        tried: set[str] = set()
        failure = error_response(503, f"no healthy {role} to serve the request")
        while True:
            candidates = [e for e in pool if e.healthy and e.url not in tried]
            if not candidates:
                return failure
            engine, predicted = choose(candidates)
            tried.add(engine.url)
            unprefilled = prompt_tokens - predicted
            async with Attempt(
                engine, self.client_session(), self.timeouts, prompt_tokens, unprefilled
            ) as attempt:
                try:
                    return await send(attempt, predicted)
                except EngineFault as fault:
                    self._engine_failed(engine, fault)
                    if fault.status is not None:
                        failure = engine_error(fault.status, fault.body)
                    else:  # unreachable 503, silent 504, broken 502 (as Envoy answers)
                        status = 503 if fault.refused else 504 if fault.timeout else 502
                        failure = error_response(status, f"{role} {engine.url} failed: {fault}")
                    if not fault.refused:
                        if retries == 0:
                            return failure
                        retries -= 1
                    self.metrics.retries.inc()

    def client_session(self) -> aiohttp.ClientSession:
        assert self.client is not None, "the router's app is not running"
        return self.client

    def upstream_headers(self, request: web.Request) -> dict[str, str]:
        # Uncompressed replies: the router reads them (errors, usage) and passes them on.
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        for name in ("Authorization", "x-api-key", "anthropic-version", "anthropic-beta"):
            if name in request.headers and not self.settings.api_keys:
                headers[name] = request.headers[name]
        return headers

    async def read_whole(self, attempt: Attempt) -> bytes:
        """A non-streamed reply's body. A 5xx is the engine's fault (raised); anything
        else, a 4xx included (the request's fault), clears the engine's failure record."""
        upstream = attempt.response
        assert upstream is not None
        body = await attempt.read_all()
        if upstream.status >= 500:
            raise EngineFault(f"answered {upstream.status}", status=upstream.status, body=body)
        self.outliers.succeeded(attempt.engine.url)
        return body

    async def answer(
        self, request: web.Request, attempt: Attempt, delivery: Delivery
    ) -> web.StreamResponse:
        """The engine's reply for the client: a stream as it arrives, anything else once
        whole, so a body cut short becomes a clean error rather than a 200 with half its
        JSON. Raises ``EngineFault`` only while nothing has reached the client."""
        upstream = attempt.response
        assert upstream is not None
        if upstream.status < 400 and upstream.content_type == "text/event-stream":
            return await self._relay(request, attempt, delivery)
        body = await self.read_whole(attempt)
        if upstream.status >= 400:  # the request's fault: pass it on, in OpenAI's shape
            response = engine_error(upstream.status, body)
        else:
            if delivery.facts is not None:
                self.served(attempt.engine, delivery.facts, delivery.predicted)
                self.count_cached(attempt.engine, UsageTap.of(body))
            response = web.Response(body=body, status=upstream.status)
            response.content_type = upstream.content_type or "application/json"
        response.headers.update(delivery.tags)
        return response

    async def _relay(
        self, request: web.Request, attempt: Attempt, delivery: Delivery
    ) -> web.StreamResponse:
        """Pass a stream on as the engine sends it. Its first chunk (after the prefill) is
        awaited before the client gets anything, so a stream that fails that early is
        still retried. Later, an engine fault ends the stream with an error event and no
        ``data: [DONE]``; a client that hung up ends it quietly, the engine blameless."""
        engine, upstream = attempt.engine, attempt.response
        assert upstream is not None
        chunk = await attempt.read(self.timeouts.first_byte_s)
        self.outliers.succeeded(engine.url)
        if delivery.facts is not None:
            self.served(engine, delivery.facts, delivery.predicted)
        response = web.StreamResponse(status=upstream.status)
        response.content_type = upstream.content_type
        response.headers.update(delivery.tags)
        usage = UsageTap()
        try:
            await response.prepare(request)
            while chunk:
                usage.feed(chunk)
                await response.write(chunk)
                chunk = await attempt.read()
            if delivery.facts is not None:  # before the client can see the end and ask
                self.count_cached(engine, usage)
            await response.write_eof()
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            log.info(json.dumps({"event": "client_gone", "engine": engine.url}))
        except EngineFault as fault:
            self._engine_failed(engine, fault)
            message = error_body(502, f"engine connection lost: {fault}")
            with contextlib.suppress(ConnectionResetError):
                await response.write(f"data: {json.dumps(message)}\n\n".encode())
        return response

    def served(self, engine: Engine, facts: RequestFacts, predicted: int) -> None:
        """The engine took the request and prefilled it: it now caches the prompt."""
        self.prefilled(engine, facts.blocks)
        self.metrics.predicted.labels(engine.url).inc(predicted)

    def prefilled(self, engine: Engine, blocks: np.ndarray) -> None:
        """The engine prefilled these blocks: it now caches them, and a global tier that
        keeps every prefill holds them too."""
        engine.remember(blocks)
        if self.global_tier is not None:
            self.global_tier.record(blocks)

    def count_cached(self, engine: Engine, usage: UsageTap) -> int | None:
        """The cached prompt tokens the engine reported, counted in the metrics."""
        cached = usage.cached_tokens()
        if cached is not None:
            self.metrics.reported.labels(engine.url).inc(cached)
        return cached

    def _engine_failed(self, engine: Engine, fault: EngineFault) -> None:
        """A lost connection ejects the engine at once (the health check re-admits it when
        it answers again); other failures count towards passive ejection."""
        log.warning(
            json.dumps({"event": "engine_failed", "engine": engine.url, "reason": str(fault)})
        )
        self.metrics.failures.labels(engine.url, fault.kind).inc()
        if fault.lost:
            self._eject(engine, str(fault))
            return
        backoff = self.outliers.failed(engine.url, time.monotonic())
        if backoff is not None:
            self._eject(engine, f"{self.settings.eject_after} failures in a row; out {backoff:g} s")

    def _eject(self, engine: Engine, reason: str) -> None:
        if engine.healthy:
            log.warning(json.dumps({"event": "eject", "engine": engine.url, "reason": reason}))
        engine.healthy = False
        self.metrics.healthy.labels(engine.url).set(0)

    # -- health --------------------------------------------------------------------------

    async def _check_health_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.check(e) for e in self.engines))
            unknown = [e for e in self.engines if e.healthy and e.url not in self.context_lengths]
            await asyncio.gather(*(self.list_models(e) for e in unknown))
            await asyncio.sleep(self.settings.health_interval_s)

    async def check(self, engine: Engine) -> None:
        assert self.client is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)
            async with self.client.get(engine.url + "/health", timeout=timeout) as response:
                ok = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        now = time.monotonic()
        if ok and not engine.healthy and not self.outliers.may_readmit(engine.url, now):
            return  # answering /health, but failing requests: out until its backoff ends
        if ok and not engine.healthy:
            engine.readmit()
            log.info(json.dumps({"event": "readmit", "engine": engine.url}))
            await self.scrape(engine)  # a restart, if any, shows in its start time
        elif not ok:
            self._eject(engine, "health check failed")
        engine.healthy = ok
        self.metrics.healthy.labels(engine.url).set(1 if ok else 0)

    async def _scrape_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.scrape(e) for e in self.engines if e.healthy))
            await asyncio.sleep(self.settings.scrape_interval_s)

    async def scrape(self, engine: Engine) -> None:
        """Read the engine's /metrics; a failed or garbled scrape just leaves the old one."""
        assert self.client is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)
            async with self.client.get(engine.url + "/metrics", timeout=timeout) as response:
                text = await response.text()
            report = parse_vllm_metrics(text, time.monotonic())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return
        previous = engine.report
        if previous is not None and engine.restarted(report):
            engine.forget()
            log.warning(json.dumps({"event": "engine_restarted", "engine": engine.url}))
            if engine.url in self.subscribers:
                await self.subscribers[engine.url].engine_restarted(since=previous.at)
        if engine.adopt(report, self.settings.block_size):
            log.info(
                json.dumps(
                    {"event": "kv_capacity", "engine": engine.url, "blocks": engine.kv_blocks}
                )
            )

    # -- small endpoints -----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        up = sum(e.healthy for e in self.engines)
        return web.json_response(
            {"status": "ok" if up else "unavailable", "healthy_engines": up},
            status=200 if up else 503,
        )

    async def models(self, request: web.Request) -> web.Response:
        """The union of the healthy engines' models, asked all at once."""
        listed = await asyncio.gather(*(self.list_models(e) for e in self.engines if e.healthy))
        seen: dict[str, dict] = {}
        for model in (m for models in listed for m in models):
            seen.setdefault(model["id"], model)
        return web.json_response({"object": "list", "data": list(seen.values())})

    async def list_models(self, engine: Engine) -> list[dict]:
        """The engine's /v1/models entries (none if it does not answer in time), noting
        the longest ``max_model_len`` among them, which caps prompts."""
        assert self.client is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)
            async with self.client.get(engine.url + "/v1/models", timeout=timeout) as response:
                data = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError, RecursionError):
            return []
        entries = data.get("data") if isinstance(data, dict) else None
        models = [m for m in entries or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        lengths = [m.get("max_model_len") for m in models]
        self.context_lengths[engine.url] = max(
            (n for n in lengths if type(n) is int and n > 0), default=0
        )
        return models

    async def prometheus(self, request: web.Request) -> web.Response:
        for engine in self.engines:
            self.metrics.inflight.labels(engine.url).set(engine.inflight)
            self.metrics.unprefilled.labels(engine.url).set(engine.unprefilled)
            self.metrics.view_blocks.labels(engine.url).set(engine.view_blocks())
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class UsageTap:
    """Finds the cached prompt tokens an engine reports in a passing response: OpenAI's
    ``usage.prompt_tokens_details.cached_tokens`` or Anthropic's ``cache_read_input_tokens``.

    Only the last chunks are kept (at least ``KEEP`` bytes of them, since usage comes in
    the last JSON body or the last SSE chunks) and joined once at the end, so the work per
    chunk is proportional to the chunk, not to what is kept.
    """

    KEEP = 1 << 16

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.kept = 0

    @classmethod
    def of(cls, body: bytes) -> UsageTap:
        """A tap that has seen a whole body."""
        tap = cls()
        tap.feed(body)
        return tap

    def feed(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.kept += len(chunk)
        while self.kept - len(self.chunks[0]) >= self.KEEP:
            self.kept -= len(self.chunks.popleft())

    def cached_tokens(self) -> int | None:
        tail = b"".join(self.chunks)[-self.KEEP :]
        for piece in reversed(tail.replace(b"data: ", b"\n").split(b"\n")):
            if b'"usage"' not in piece:
                continue
            try:
                usage = json.loads(piece).get("usage") or {}
            except (ValueError, AttributeError):
                continue
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
            if isinstance(cached, int):
                return cached
        return None
