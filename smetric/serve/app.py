"""``smetric serve``: an OpenAI-compatible router running the policies of ``smetric.core``.

Each request is analysed from its body alone (turn, expected hit, prompt blocks; no session
table), the policy picks an engine from the view the simulator also builds (local prefix
hit per engine from the router's own index, in-flight requests as load), and the response
streams back chunk by chunk as the engine sends it. A request counts as in flight from the
moment it is routed until its response ends, fails or the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from smetric.core.block_memo import BlockMemo
from smetric.core.blocks import ByteTokenizer, Tokenizer
from smetric.core.conversation import (
    Api,
    ChatTemplate,
    RequestError,
    RequestFacts,
    analyze_request,
)
from smetric.core.parsing import decode_body
from smetric.core.policy import ClusterView, make_policy
from smetric.serve.engines import Engine, QueuedPrefill
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.metrics import RouterMetrics, SubscriberCollector
from smetric.serve.scrape import parse_vllm_metrics
from smetric.serve.tokenizers import EngineTokens, analyze_with_engine

log = logging.getLogger("smetric.serve")

ENGINE_HEADER = "x-smetric-engine"
# What the router expected the engine to find cached, so a client can set it beside the
# engine's own ``cached_tokens`` request by request.
PREDICTED_HIT_HEADER = "x-smetric-predicted-hit-tokens"
# Bodies above this are analysed off the event loop.
_OFF_LOOP_BYTES = 64 << 10
_ROUTES: dict[str, Api] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
}


@dataclass
class RouterSettings:
    policy: str = "smetric"
    block_size: int = 16
    api_keys: frozenset[str] = frozenset()
    health_interval_s: float = 2.0
    max_body_bytes: int = 32 << 20
    connect_timeout_s: float = 5.0
    # Scrape engines' /metrics this often (0: never) and trust a scrape this long.
    scrape_interval_s: float = 0.0
    staleness_s: float = 5.0
    # Bound of the memo of rendered, tokenised and hashed message prefixes.
    memo_bytes: int = 256 << 20


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """An OpenAI-style error body, so clients' SDKs surface the message."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


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

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("the router needs at least one engine")
        self.policy = make_policy(self.settings.policy)
        self.metrics = RouterMetrics(self.policy.name, [e.url for e in self.engines])
        self.metrics.registry.register(SubscriberCollector(self.subscribers))
        self.client: aiohttp.ClientSession | None = None
        # Follow-ups re-send earlier turns: their blocks are looked up, not recomputed.
        memo_tokenizer = EngineTokens() if self.engine_tokenizer else self.tokenizer
        self.memo = BlockMemo(memo_tokenizer, self.settings.block_size, self.settings.memo_bytes)
        # Each engine's number in the configuration, stable while others come and go.
        self._numbers = {e.url: i for i, e in enumerate(self.engines)}

    # -- application --------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_body_bytes, middlewares=[self._errors]
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
        self.client = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        for subscriber in self.subscribers.values():
            await subscriber.start()
        tasks = [asyncio.create_task(self._check_health_forever())]
        if self.settings.scrape_interval_s > 0:
            tasks.append(asyncio.create_task(self._scrape_forever()))
        yield
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks)
        for subscriber in self.subscribers.values():
            await subscriber.close()
        await self.client.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Whatever goes wrong answers in OpenAI's error shape, with the right 4xx."""
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, "request body too large")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.reason)

    # -- proxying ------------------------------------------------------------------------

    def _handler(self, path: str, api: Api) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.proxy(request, path, api)

        return handle

    def _authorised(self, request: web.Request) -> bool:
        if not self.settings.api_keys:
            return True
        header = request.headers.get("Authorization", "")
        key = header.removeprefix("Bearer ").strip() or request.headers.get("x-api-key", "")
        return key in self.settings.api_keys

    async def proxy(self, request: web.Request, path: str, api: Api) -> web.StreamResponse:
        if not self._authorised(request):
            return error_response(401, "missing or invalid API key", "authentication_error")
        raw = await request.read()
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
            return error_response(502, f"tokenising with the engine failed: {exc}", "server_error")
        started = time.perf_counter()
        tried: set[str] = set()
        while True:
            candidates = [e for e in self.engines if e.healthy and e.url not in tried]
            if not candidates:
                return error_response(503, "no healthy engine to serve the request", "server_error")
            engine, predicted = self.route(facts, candidates)
            tried.add(engine.url)
            engine.inflight += 1
            engine.inflight_tokens += facts.prompt_tokens
            prefill = QueuedPrefill(engine, facts.prompt_tokens - predicted)
            try:
                try:
                    upstream = await self._send(engine, path, raw, request)
                except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                    # Nothing reached the client yet: eject the engine, try another.
                    engine.inflight -= 1
                    self._eject(engine, f"connect failed: {exc!r}")
                    self.metrics.retries.inc()
                    continue
                try:
                    return await self._relay(request, engine, upstream, facts, predicted, prefill)
                finally:
                    engine.inflight -= 1
                    upstream.release()
                    self.metrics.latency.labels(api).observe(time.perf_counter() - started)
            finally:
                prefill.done()
                engine.inflight_tokens -= facts.prompt_tokens

    async def analyze(self, body: dict, api: Api, large: bool = False) -> RequestFacts:
        """Facts for routing. A large body is analysed in a worker thread: a follow-up costs
        about a millisecond there (the memo holds its history), but a new 128 k-token prompt
        takes a few ms with the byte tokenizer and far more with a model's, which releases
        the GIL while it encodes, so other requests keep streaming meanwhile."""
        bs = self.settings.block_size
        if not self.engine_tokenizer:
            args = (body, api, self.tokenizer, bs, self.template, self.memo)
            if large:
                return await asyncio.to_thread(analyze_request, *args)
            return analyze_request(*args)
        assert self.client is not None
        engine = next((e for e in self.engines if e.healthy), self.engines[0])
        # A router switched to engine tokenisation after it was made has no memo for it.
        memo = self.memo if isinstance(self.memo.tokenizer, EngineTokens) else None
        return await analyze_with_engine(
            body, api, self.client, engine.url, bs, self.template, memo
        )

    def route(self, facts: RequestFacts, engines: list[Engine]) -> tuple[Engine, int]:
        bs = self.settings.block_size
        hits = [e.predicted_hit(facts.blocks, bs, facts.prompt_tokens) for e in engines]
        now = time.monotonic()
        loads = [e.load(now, self.settings.staleness_s) for e in engines]
        view = ClusterView(
            hit_tokens=hits,
            load=loads,
            prefill_tokens=[float(e.total_unprefilled()) for e in engines],
            instance_ids=[self._numbers[e.url] for e in engines],
            # The router does not see the global tier: global_hit_tokens stays unknown.
            token_load=[float(e.total_inflight_tokens()) for e in engines],
        )
        decision = self.policy.route(facts.routing_request(), view)
        engine = engines[decision.instance]
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
                        "predicted_hit_tokens": hits[decision.instance],
                        "loads": loads,
                    }
                )
            )
        return engine, hits[decision.instance]

    async def _send(
        self, engine: Engine, path: str, raw: bytes, request: web.Request
    ) -> aiohttp.ClientResponse:
        assert self.client is not None
        headers = {"Content-Type": "application/json"}
        for name in ("Authorization", "x-api-key", "anthropic-version", "anthropic-beta"):
            if name in request.headers and not self.settings.api_keys:
                headers[name] = request.headers[name]
        return await self.client.post(engine.url + path, data=raw, headers=headers)

    async def _relay(
        self,
        request: web.Request,
        engine: Engine,
        upstream: aiohttp.ClientResponse,
        facts: RequestFacts,
        predicted: int,
        prefill: QueuedPrefill,
    ) -> web.StreamResponse:
        """Pass the engine's response through as it arrives; end cleanly if it breaks.

        The first chunk of a body means the prompt was prefilled (vLLM streams nothing
        before the first token), so the request stops counting as unprefilled then.
        """
        response = web.StreamResponse(status=upstream.status)
        response.content_type = upstream.content_type or "application/json"
        response.headers[ENGINE_HEADER] = engine.url
        response.headers[PREDICTED_HIT_HEADER] = str(predicted)
        await response.prepare(request)
        if upstream.status == 200:
            engine.remember(facts.blocks)
            self.metrics.predicted.labels(engine.url).inc(predicted)
        usage = _UsageTap()
        try:
            async for chunk in upstream.content.iter_any():
                prefill.done()
                usage.feed(chunk)
                await response.write(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            log.warning(json.dumps({"event": "upstream_broke", "engine": engine.url}))
            self._eject(engine, f"stream broke: {exc!r}")
            message = {"error": {"message": "engine connection lost", "type": "server_error"}}
            if response.content_type == "text/event-stream":
                await response.write(f"data: {json.dumps(message)}\n\n".encode())
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away: stop reading from the engine so it can free the slot.
            upstream.close()
            raise
        cached = usage.cached_tokens()
        if cached is not None:
            self.metrics.reported.labels(engine.url).inc(cached)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()  # the client may be gone by now
        return response

    def _eject(self, engine: Engine, reason: str) -> None:
        if engine.healthy:
            log.warning(json.dumps({"event": "eject", "engine": engine.url, "reason": reason}))
        engine.healthy = False
        self.metrics.healthy.labels(engine.url).set(0)

    # -- health --------------------------------------------------------------------------

    async def _check_health_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.check(e) for e in self.engines))
            await asyncio.sleep(self.settings.health_interval_s)

    async def check(self, engine: Engine) -> None:
        assert self.client is not None
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)
            async with self.client.get(engine.url + "/health", timeout=timeout) as response:
                ok = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok and not engine.healthy:
            engine.readmit()
            log.info(json.dumps({"event": "readmit", "engine": engine.url}))
            if self.settings.scrape_interval_s > 0:
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
        assert self.client is not None
        seen: dict[str, dict] = {}
        for engine in (e for e in self.engines if e.healthy):
            try:
                async with self.client.get(engine.url + "/v1/models") as response:
                    data = await response.json()
            except (TimeoutError, aiohttp.ClientError, ValueError):
                continue
            for model in data.get("data", []) if isinstance(data, dict) else []:
                if isinstance(model, dict) and "id" in model:
                    seen.setdefault(model["id"], model)
        return web.json_response({"object": "list", "data": list(seen.values())})

    async def prometheus(self, request: web.Request) -> web.Response:
        for engine in self.engines:
            self.metrics.inflight.labels(engine.url).set(engine.inflight)
            self.metrics.unprefilled.labels(engine.url).set(engine.unprefilled)
            self.metrics.view_blocks.labels(engine.url).set(engine.view_blocks())
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class _UsageTap:
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
