"""vLLM's observable HTTP surface over ``MockEngine``: what a router sends and scrapes.

Only what routers and load generators touch is modelled: the OpenAI chat and completions
endpoints (streamed or not, with ``usage.prompt_tokens_details.cached_tokens`` as vLLM
reports it with ``--enable-prompt-tokens-details``), Anthropic Messages
(``engine/anthropic``), the OpenAI Responses API with its store (``engine/responses``),
``/tokenize``, ``/v1/models``, ``/health`` and ``/metrics`` under vLLM's metric names.
Prompts are parsed by ``core.conversation.analyze_request``, the router's own parser, so
router and engine agree on every prompt's tokens and blocks, and its ``RequestError``
becomes a 400. Any model name is accepted in requests, so a router configured with another
name still gets answers. What a reply holds is planned before it is generated, the same
way for every API (``engine/agent``): filler text up to ``max_tokens``, or in agent mode
(``engine.agent``) a short reply or a read-only tool call, which each API renders in its
own shapes; the plan's token count is what the scheduler generates.

With ``kv_events_endpoint`` set, the engine's KV events go out over ZMQ exactly as vLLM's
``ZmqEventPublisher`` sends them: multipart ``[topic, seq (8-byte big-endian), payload]``
with the payload ``[ts, [events], dp_rank]`` in msgpack, numbered from 0 per process, and a
ROUTER on ``kv_events_replay_endpoint`` that resends buffered batches from a number.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from smetric.core.blocks import ByteTokenizer
from smetric.core.conversation import Api, RequestError, analyze_request
from smetric.core.kv_events import REPLAY_END
from smetric.core.responses_api import response_not_found
from smetric.engine.agent import ReplyPlan, plan_reply
from smetric.engine.anthropic import MessagesReply, messages_usage
from smetric.engine.disagg import KV_TRANSFER_PARAMS, PULL_PATH, TRANSFERS, KVTransfers, handle_pull
from smetric.engine.responses import (
    ResponsesReply,
    ResponseStore,
    Stored,
    input_items,
    responses_usage,
)
from smetric.engine.scheduler import END, EngineConfig, EngineRequest, MockEngine, filler_token

ENGINE = web.AppKey("engine", MockEngine)
# vLLM reads any body; an agent's request carries its whole conversation, images included.
MAX_BODY_BYTES = 1 << 30
REGISTRY = web.AppKey("registry", CollectorRegistry)
RESPONSES = web.AppKey("responses", ResponseStore)
_TOKENIZER = ByteTokenizer()


def create_app(config: EngineConfig) -> web.Application:
    """An app whose engine loop runs while the app does; metrics live in its own registry.

    A private registry lets several engines share one process, as the tests and a local
    demo cluster do.
    """
    publisher = KVEventPublisher(config) if config.kv_events_endpoint else None
    engine = MockEngine(config, None if publisher is None else publisher.publish)
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[REGISTRY] = registry
    app[RESPONSES] = ResponseStore()
    if publisher is not None:
        app[KV_EVENTS] = publisher
        app.cleanup_ctx.append(publisher.serve)
    app.cleanup_ctx.append(_engine_loop)
    app[TRANSFERS] = KVTransfers(engine, config.role, config.kv_link_gb_s * 1e9, config.kv_lease_s)
    app.cleanup_ctx.append(app[TRANSFERS].session)
    app.router.add_post(PULL_PATH, handle_pull)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/messages", _messages)
    app.router.add_post("/v1/messages/count_tokens", _count_tokens)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_get("/v1/responses/{id}", _get_response)
    app.router.add_delete("/v1/responses/{id}", _delete_response)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/model_info", _model_info)
    app.router.add_get("/server_info", _server_info)
    app.router.add_get("/metrics", _metrics)
    return app


def run_engine(
    config: EngineConfig,
    sock: socket.socket,
    on_ready: Callable[[web.Application], None] | None = None,
) -> None:
    """Serve on the listening ``sock`` until interrupted; a client that disconnects cancels
    its request at once. ``on_ready`` runs once the app's sockets are all bound, so what it
    says of their addresses holds."""
    app = create_app(config)
    if on_ready is not None:

        async def ready(app: web.Application) -> None:
            on_ready(app)

        app.on_startup.append(ready)  # after the cleanup contexts, which bind ZMQ
    web.run_app(app, sock=sock, print=None, handler_cancellation=True)


async def _engine_loop(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[ENGINE].run())
    yield
    task.cancel()


def publisher_binds(endpoint: str) -> bool:
    """Whether vLLM's ``ZmqEventPublisher`` binds ``endpoint`` rather than connects to it:
    a wildcard host (``tcp://*:port``, or ``::``) or a local transport (``ipc://``,
    ``inproc://``) binds; a named host is where a subscriber listens. (The newest vLLM
    always binds; the releases in use decide so.)"""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The engine's KV events on the wire, with vLLM's sequence numbers and replay buffer."""

    def __init__(self, config: EngineConfig) -> None:
        if config.kv_events_endpoint is None:
            raise ValueError("KV events need kv_events_endpoint")
        # What the sockets use: once bound, the addresses they got (``tcp://host:*`` binds
        # a port the OS picks, which subscribers then need to know).
        self.endpoint = config.kv_events_endpoint
        self.replay_endpoint = config.kv_events_replay_endpoint
        self.config = config
        self.topic = config.kv_events_topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.kv_events_buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._pub: zmq.asyncio.Socket | None = None

    async def serve(self, app: web.Application) -> AsyncIterator[None]:
        """Open the sockets for the app's lifetime (an aiohttp cleanup context)."""
        config = self.config
        context = zmq.asyncio.Context()
        pub = context.socket(zmq.PUB)
        bind = config.kv_events_bind
        if publisher_binds(self.endpoint) if bind is None else bind:
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(self.endpoint)
        self._pub = pub
        replay_task = None
        if self.replay_endpoint is not None:
            router = context.socket(zmq.ROUTER)
            # A full queue to one subscriber waits rather than drops: a replay that loses
            # batches is useless to it.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.bind(self.replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            replay_task = asyncio.create_task(self._replay(router))
        try:
            yield
        finally:
            self._pub = None
            if replay_task is not None:
                replay_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await replay_task
            context.destroy(linger=0)

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Number, buffer and send one step's events; PUB drops rather than blocks, as vLLM's."""
        payload = self._encoder.encode([time.time(), events, 0])
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if self._pub is not None:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    async def _replay(self, router: zmq.asyncio.Socket) -> None:
        end = REPLAY_END.to_bytes(8, "big", signed=True)
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            answer = [(seq, p) for seq, p in self.buffer if seq >= first]
            # A subscriber that left before its answer was sent is no reason to stop.
            with contextlib.suppress(zmq.ZMQError):
                for seq, payload in answer:
                    await router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                await router.send_multipart([client, b"", end, b""])


KV_EVENTS = web.AppKey("kv_events", KVEventPublisher)


# --- Generation ----------------------------------------------------------------------------


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completions")


async def _messages(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "messages")


async def _generate(request: web.Request, api: Api) -> web.StreamResponse:
    engine = request.app[ENGINE]
    config = engine.config
    try:
        body = await _json_body(request)
        facts = analyze_request(body, api, _TOKENIZER, config.block_size)
        assert isinstance(body, dict)  # analyze_request accepts nothing but an object
        bound, stream, include_usage = _sampling(body, api)
        params = body.get(KV_TRANSFER_PARAMS)
        transfers = request.app[TRANSFERS]
        transfers.check(params)
        _check_context(facts.prompt_tokens, bound, config)
    except RequestError as error:
        return _error(str(error), api=api)
    # A remote prefill's blocks are read before the request is scheduled, as vLLM's
    # connector loads them; they stay pinned until the request is done with them.
    pulled = (
        await transfers.pull(facts, params) if params and params.get("do_remote_prefill") else None
    )
    plan = plan_reply(config, body, facts, bound, may_call=api != "completions")
    job = EngineRequest(facts.token_ids, facts.blocks, plan.tokens)
    engine.submit(job)
    try:
        if api == "messages":
            return await _anthropic(
                request, job, MessagesReply(config.served_model_name, plan), stream
            )
        reply = _Reply(api, config.served_model_name, plan)
        if stream:
            return await _stream(request, job, reply, include_usage)
        while await job.tokens.get() is not END:
            pass
        answer = reply.full(_usage(job))
        if params and params.get("do_remote_decode"):
            host, port = request.url.host, request.url.port
            # A served request's URL is absolute: a host, and a port given or the scheme's.
            assert host is not None and port is not None
            answer[KV_TRANSFER_PARAMS] = transfers.hold(job, host, port)
        return web.json_response(answer)
    finally:
        engine.cancel(job)
        if pulled is not None:
            engine.pool.cache.unlock(pulled, asyncio.get_running_loop().time())


async def _stream(
    request: web.Request, job: EngineRequest, reply: _Reply, include_usage: bool
) -> web.StreamResponse:
    """Server-sent events, one chunk per token as vLLM sends them; a gone client cancels.

    The headers leave at once, the body's first bytes only with the first token: vLLM's
    ``OpenAIServingChat.chat_completion_stream_generator`` sends the role chunk on the
    first output the engine yields (``first_iteration``), and a prefill yields none.
    """
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        index = await job.tokens.get()
        for chunk in reply.opening():
            await _send(response, chunk)
        while index is not END:
            following = await job.tokens.get()
            await _send(response, reply.token(index, last=following is END))
            index = following
        if include_usage:
            await _send(response, reply.usage(_usage(job)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the caller's finally cancels the request and frees its blocks
    return response


async def _anthropic(
    request: web.Request, job: EngineRequest, reply: MessagesReply, stream: bool
) -> web.StreamResponse:
    """The Messages API's shapes: one JSON message, or its named server-sent events.

    As on the chat stream, nothing of the body precedes the first token: vLLM's
    ``AnthropicServingMessages.message_stream_converter`` opens the message on the chat
    stream's first chunk.
    """
    if not stream:
        while await job.tokens.get() is not END:
            pass
        return web.json_response(reply.full(_anthropic_usage(job)))
    return await _event_stream(
        request,
        job,
        lambda: reply.opening(_anthropic_usage(job)),
        reply.token,
        lambda: reply.closing(_anthropic_usage(job)),
    )


def _anthropic_usage(job: EngineRequest) -> dict[str, int]:
    return messages_usage(job.prompt_tokens, job.cached_tokens, job.generated)


async def _responses(request: web.Request) -> web.StreamResponse:
    """The Responses API: the prompt is the stored conversation a ``previous_response_id``
    names (404 if this engine holds none by that id) followed by ``input``."""
    engine = request.app[ENGINE]
    config = engine.config
    store = request.app[RESPONSES]
    try:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        previous = body.get("previous_response_id")
        history: list[Any] = []
        if previous is not None:
            stored = store.get(previous) if isinstance(previous, str) else None
            if stored is None:
                return web.json_response(
                    response_not_found(str(previous), "previous_response_id"), status=404
                )
            history = stored.conversation
        conversation = [*history, *input_items(body)]
        whole = {**body, "input": conversation}
        facts = analyze_request(whole, "responses", _TOKENIZER, config.block_size)
        bound, stream, _ = _sampling(body, "responses")
        _check_context(facts.prompt_tokens, bound, config)
    except RequestError as error:
        return _error(str(error))
    plan = plan_reply(config, whole, facts, bound, may_call=True)
    job = EngineRequest(facts.token_ids, facts.blocks, plan.tokens)
    engine.submit(job)
    reply = ResponsesReply(config.served_model_name, body, plan)

    def finished() -> dict[str, Any]:
        """The whole response, stored (before the client can see its end and follow up)."""
        answer = reply.response(_responses_usage(job))
        if body.get("store", True) is not False:
            store.put(Stored(answer, [*conversation, *answer["output"]]))
        return answer

    try:
        if stream:
            return await _event_stream(
                request, job, reply.opening, reply.token, lambda: reply.closing(finished())
            )
        while await job.tokens.get() is not END:
            pass
        return web.json_response(finished())
    finally:
        engine.cancel(job)


async def _event_stream(
    request: web.Request,
    job: EngineRequest,
    opening: Callable[[], Iterable[bytes]],
    token: Callable[[int], bytes],
    closing: Callable[[], Iterable[bytes]],
) -> web.StreamResponse:
    """Named server-sent events (Messages, Responses): ``opening`` once the first token is
    out, as the chat stream opens (what it says, usage included, is read then), one event
    per token, then ``closing``; a gone client cancels."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    try:
        index = await job.tokens.get()
        for data in opening():
            await response.write(data)
        while index is not END:
            await response.write(token(index))
            index = await job.tokens.get()
        for data in closing():
            await response.write(data)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the caller's finally cancels the request and frees its blocks
    return response


def _responses_usage(job: EngineRequest) -> dict[str, Any]:
    return responses_usage(job.prompt_tokens, job.cached_tokens, job.generated)


async def _get_response(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    stored = request.app[RESPONSES].get(response_id)
    if stored is None:
        return web.json_response(response_not_found(response_id), status=404)
    return web.json_response(stored.response)


async def _delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    if request.app[RESPONSES].pop(response_id) is None:
        return web.json_response(response_not_found(response_id), status=404)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(chunk)}\n\n".encode())


class _Reply:
    """The OpenAI response and chunk shapes of one request's plan, for either endpoint."""

    def __init__(self, api: Api, model: str, plan: ReplyPlan) -> None:
        self.chat = api == "chat"
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.plan = plan

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, usage: dict[str, Any]) -> dict[str, Any]:
        plan = self.plan
        text = "".join(filler_token(i) for i in range(plan.text_tokens))
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if plan.call is not None:
                function = {"name": plan.call.name, "arguments": plan.call.arguments_json}
                call = {"id": f"call_{plan.call.id}", "type": "function", "function": function}
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
            choice = {"index": 0, "message": message, "finish_reason": plan.finish}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": plan.finish}
            body = self._envelope("text_completion", [choice])
        return {**body, "usage": usage}

    def opening(self) -> Iterable[dict[str, Any]]:
        """vLLM opens a chat stream with an empty assistant delta, sent with the first
        token; completions have no opening chunk."""
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            yield self._chunk({"index": 0, "delta": delta, "finish_reason": None})

    def token(self, index: int, *, last: bool) -> dict[str, Any]:
        """Token ``index``'s chunk: a word of text, or a piece of the call's arguments (the
        first piece with the call's id and name)."""
        reason = self.plan.finish if last else None
        call = self.plan.call
        if call is not None:
            function: dict[str, Any] = {"arguments": call.pieces[index]}
            opening: dict[str, Any] = {}
            if index == 0:
                function = {"name": call.name, **function}
                opening = {"id": f"call_{call.id}", "type": "function"}
            calls = [{"index": 0, **opening, "function": function}]
            return self._chunk(
                {"index": 0, "delta": {"tool_calls": calls}, "finish_reason": reason}
            )
        if self.chat:
            delta = {"content": filler_token(index)}
            return self._chunk({"index": 0, "delta": delta, "finish_reason": reason})
        text = filler_token(index)
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": reason})

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._chunk(None), "usage": usage}

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [] if choice is None else [choice])


def _usage(job: EngineRequest) -> dict[str, Any]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.generated,
        "total_tokens": job.prompt_tokens + job.generated,
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


# Where each API puts its limit on output tokens, the first one set applying.
_BOUNDS: dict[Api, tuple[str, ...]] = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


def _sampling(body: dict[str, Any], api: Api) -> tuple[int | None, bool, bool]:
    """The output bound (None where the request sets none), ``stream`` and
    ``stream_options.include_usage``, type-checked."""
    bound = next((body[k] for k in _BOUNDS[api] if body.get(k) is not None), None)
    if bound is not None and (type(bound) is not int or bound < 1):
        name = _BOUNDS[api][-1]
        raise RequestError(f"{name} must be a positive integer, got {bound!r}")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be a boolean, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean")
    return bound, stream, include_usage


# --- Everything else -----------------------------------------------------------------------


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``messages`` render as a chat prompt, ``prompt`` as is."""
    config = request.app[ENGINE].config
    try:
        body = await _json_body(request)
        api: Api = "chat" if isinstance(body, dict) and "messages" in body else "completions"
        facts = analyze_request(body, api, _TOKENIZER, config.block_size)
    except RequestError as error:
        return _error(str(error))
    return web.json_response(
        {
            "count": facts.prompt_tokens,
            "max_model_len": config.context_len,
            "tokens": facts.token_ids.tolist(),
            "token_strs": None,
        }
    )


async def _count_tokens(request: web.Request) -> web.Response:
    """Anthropic's token count: the prompt's tokens as ``/v1/messages`` would prefill it."""
    config = request.app[ENGINE].config
    try:
        facts = analyze_request(
            await _json_body(request), "messages", _TOKENIZER, config.block_size
        )
    except RequestError as error:
        return _error(str(error))
    return web.json_response({"input_tokens": facts.prompt_tokens})


async def _models(request: web.Request) -> web.Response:
    config = request.app[ENGINE].config
    model = {
        "id": config.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "smetric",
        "root": config.served_model_name,
        "max_model_len": config.context_len,
    }
    return web.json_response({"object": "list", "data": [model]})


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def _model_info(request: web.Request) -> web.Response:
    """SGLang's ``/model_info``: sglang-router probes it before it accepts a worker."""
    config = request.app[ENGINE].config
    return web.json_response({"model_path": config.served_model_name, "is_generation": True})


async def _server_info(request: web.Request) -> web.Response:
    """SGLang's ``/server_info``: the engine's configuration, which routers read at startup."""
    config = request.app[ENGINE].config
    return web.json_response({**asdict(config), "max_model_len": config.context_len})


async def _metrics(request: web.Request) -> web.Response:
    payload = generate_latest(request.app[REGISTRY])
    return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})


class _EngineCollector:
    """Reads the engine's state at scrape time, so no gauge can lag behind the engine."""

    def __init__(self, engine: MockEngine) -> None:
        self.engine = engine
        # As a real engine's process collector reports it: a router reads a change as a
        # restart. One per app, since several mock engines may share a process.
        self.started_at = time.time()

    def collect(self) -> Iterable[Metric]:
        engine = self.engine
        config = engine.config
        counters = engine.counters
        label = ["model_name"]
        value = [config.served_model_name]

        def gauge(name: str, doc: str, reading: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=label)
            family.add_metric(value, reading)
            return family

        def counter(name: str, doc: str, reading: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=label)
            family.add_metric(value, reading)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the batch.", engine.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for KV.", len(engine.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV blocks in use.", engine.kv_cache_usage)
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up.", counters.prefix_cache_queries
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found cached.", counters.prefix_cache_hits
        )
        yield counter(
            "vllm:prompt_tokens_cached", "Prompt tokens found cached.", counters.prefix_cache_hits
        )
        yield counter("vllm:prompt_tokens", "Prefilled prompt tokens.", counters.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generated tokens.", counters.generation_tokens)
        yield counter("vllm:request_success", "Requests finished.", counters.finished_requests)
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the engine since the Unix epoch.",
            value=self.started_at,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV cache configuration.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric([str(config.block_size), str(config.kv_blocks), "True"], 1.0)
        yield info


# --- Helpers -------------------------------------------------------------------------------


def _check_context(prompt_tokens: int, bound: int | None, config: EngineConfig) -> None:
    """The prompt and the most the reply may be fit the context (with no bound set,
    ``default_max_tokens``, the least any reply has room for)."""
    if prompt_tokens == 0:
        raise RequestError("the prompt must not be empty")
    max_tokens = config.default_max_tokens if bound is None else bound
    if prompt_tokens + max_tokens > config.context_len:
        raise RequestError(
            f"This model's maximum context length is {config.context_len} tokens; the "
            f"request has {prompt_tokens} prompt tokens and max_tokens {max_tokens}"
        )


async def _json_body(request: web.Request) -> object:
    try:
        return json.loads(await request.read())
    except (ValueError, RecursionError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None


def _error(message: str, status: int = 400, api: Api = "chat") -> web.Response:
    """A refused request in its API's error shape: Anthropic's for Messages, as vLLM's
    Anthropic server answers, OpenAI's for the rest."""
    if api == "messages":
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
    else:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)
