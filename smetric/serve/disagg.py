"""``smetric serve`` in front of a disaggregated cluster: prefill engines and decode engines.

It speaks, through each engine's backend (``serve.backends``), the protocol of vLLM's
disaggregated serving proxy (the toy proxy in vLLM's
``examples/online_serving/disaggregated_serving`` and its NIXL integration tests):

1. The client's request goes to a prefill engine with ``max_tokens`` (and
   ``max_completion_tokens``) 1, not streamed, and ``kv_transfer_params`` saying
   ``do_remote_decode: true`` (the remote fields empty). The engine prefills, keeps the
   prompt's blocks, and answers with ``kv_transfer_params`` for the decode side
   (``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id``, ``remote_host``,
   ``remote_port``, ...). Its one generated token is dropped.
2. The original request, with those parameters added, goes to a decode engine, which
   reads the blocks from the prefill engine and generates; its response streams back.

The prefill engine is chosen by the policy under test, on a view whose load is each
prefill engine's unprefilled prompt tokens in flight (the prompt minus the predicted hit,
Figure 13 line 29), so the same policy code as the simulator's disaggregated mode runs
here. The decode engine is chosen by ``decode_policy``, the simulator's decode policies
(``core.policies.decode``) over the engines' requests in flight and scraped
``kv_cache_usage`` (unknown where the scrape is stale).

Failures are handled as for colocated engines, each leg with its own ``forwarding.Tries``
(``serve.upstream.Attempt``: the leg's load, the ``first_byte_timeout_s`` and
``idle_timeout_s`` timeouts; passive ejection; errors in the API's own shape). A prefill engine
that is unreachable, answers 5xx or garbage, or stalls is left out and the prefill tried
on another; a decode engine that fails before the client got a byte gets the same
parameters sent to another decode engine: the prefill engine still holds the blocks (vLLM
keeps them until read or until its lease runs out; a decode engine that finds them gone
recomputes), so nothing is prefilled twice. Each leg has its own ``retries`` budget; a
refused connection does not spend it. A decode that fails mid-stream ends with an error
event and no ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from smetric.core.errors import ConfigError
from smetric.core.headers import (
    DECODE_HEADER,
    PREDICTED_HIT_HEADER,
    PREFILL_CACHED_HEADER,
    PREFILL_HEADER,
    PREFILL_SECONDS_HEADER,
)
from smetric.core.policies.decode import (
    DEFAULT_DECODE_POLICY,
    DecodePolicy,
    DecodeView,
    make_decode_policy,
)
from smetric.serve.dispatch import Call, Wiring
from smetric.serve.engines import Engine
from smetric.serve.errors import dialect_for
from smetric.serve.forwarding import Outcome, UsageTap
from smetric.serve.upstream import Attempt, EngineFault

log = logging.getLogger("smetric.serve")


@dataclass(frozen=True)
class Prefilled:
    """A finished prefill leg: where, what it answered, what it hit, how long."""

    engine: Engine
    answer: dict[str, Any]
    cached_tokens: int | None
    predicted: int
    seconds: float

    def tags(self) -> dict[str, str]:
        """The client's headers about this leg, which ``smetric replay`` measures with."""
        tags = {
            PREFILL_HEADER: self.engine.url,
            PREFILL_SECONDS_HEADER: f"{self.seconds:.6f}",
            PREDICTED_HIT_HEADER: str(self.predicted),
        }
        if self.cached_tokens is not None:
            tags[PREFILL_CACHED_HEADER] = str(self.cached_tokens)
        return tags


@dataclass
class Disaggregation:
    """Which engines prefill and which decode, and how each is chosen; a dispatcher once
    ``attach``ed to the router's parts."""

    prefill_urls: frozenset[str]
    decode_urls: frozenset[str]
    decode_policy: str = DEFAULT_DECODE_POLICY
    staleness_s: float = 5.0
    _decode: DecodePolicy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ConfigError("a disaggregated cluster needs prefill and decode engines")
        if self.prefill_urls & self.decode_urls:
            raise ConfigError("an engine cannot be both a prefill and a decode engine")
        self._decode = make_decode_policy(self.decode_policy)

    def attach(self, wiring: Wiring) -> Disaggregation:
        self.wiring = wiring
        self.staleness_s = wiring.core.staleness_s
        self.routed = wiring.metrics.pd_routed
        return self

    def roles(self) -> dict[str, int]:
        pool = self.wiring.pool
        return {
            "prefill": len(pool.healthy(self.prefill_urls)),
            "decode": len(pool.healthy(self.decode_urls)),
        }

    # -- choosing -------------------------------------------------------------------------

    def choose_decode(self, engines: list[Engine]) -> Engine:
        now = time.monotonic()

        def kv_used(engine: Engine) -> float | None:
            report = engine.report
            fresh = report is not None and now - report.at <= self.staleness_s
            return report.kv_usage if fresh and report is not None else None

        view = DecodeView([e.total_inflight() for e in engines], [kv_used(e) for e in engines])
        decision = self._decode.choose(view)
        engine = engines[decision.instance]
        if log.isEnabledFor(logging.INFO):
            event = {"event": "route_decode", "engine": engine.url, "rule": self.decode_policy}
            log.info(json.dumps({**event, "branch": decision.branch}))
        return engine

    # -- the two legs -----------------------------------------------------------------------

    async def dispatch(self, call: Call) -> web.StreamResponse:
        forwarder, completion = self.wiring.forwarder, call.completion
        headers = forwarder.upstream_headers(call.request.headers)
        prefilled = await self.prefill(call, headers)
        if not isinstance(prefilled, Prefilled):
            return prefilled  # no prefill engine could, or the request's own error
        completion.prefill_engine = prefilled.engine.url
        completion.prefill_cached_tokens = prefilled.cached_tokens
        admitted = call.admitted
        prompt_tokens = admitted.facts.prompt_tokens
        tries = forwarder.tries("decode engine", completion)
        while engines := tries.untried(self.wiring.pool.healthy(self.decode_urls)):
            engine = self.choose_decode(engines)
            # The decode engine pulls the prompt's KV: none of it is left to prefill there.
            async with tries.on(engine, prompt_tokens, prompt_tokens) as attempt:
                self.routed.labels("decode", engine.url).inc()
                payload = json.dumps(engine.backend.decode_request(admitted.body, prefilled.answer))
                await attempt.send(admitted.path, payload.encode(), headers, stream=admitted.stream)
                reply = await forwarder.open(attempt, completion)
                tags = {**prefilled.tags(), DECODE_HEADER: engine.url}
                return await forwarder.relay(call.request, attempt, reply, tags, completion)
        return tries.given_up()

    async def prefill(self, call: Call, headers: dict[str, str]) -> Prefilled | web.Response:
        """The prefill leg, on the engine the policy picks, on unprefilled prompt tokens as
        load (Figure 13, line 29): the router's policy balances them when it serves
        disaggregated."""
        wiring = self.wiring
        tries = wiring.forwarder.tries("prefill engine", call.completion)
        while engines := tries.untried(wiring.pool.healthy(self.prefill_urls)):
            decision = wiring.decide_call(call, engines)
            engine, predicted = decision.engine, decision.predicted_hit_tokens
            async with tries.on(engine, call.admitted.facts.prompt_tokens, predicted) as attempt:
                self.routed.labels("prefill", engine.url).inc()
                started = time.monotonic()
                leg = json.dumps(engine.backend.prefill_request(call.admitted.body)).encode()
                await attempt.send(call.admitted.path, leg, headers)
                raw = await wiring.forwarder.read_whole(attempt)
                seconds = time.monotonic() - started
                return self._prefilled(call, attempt, raw, predicted, seconds)
        return tries.given_up()

    def _prefilled(
        self, call: Call, attempt: Attempt, raw: bytes, predicted: int, seconds: float
    ) -> Prefilled | web.Response:
        """The prefill engine's whole answer: the request's own error (a 4xx) for the
        client, else what it hands the decode leg, and its reuse."""
        assert attempt.response is not None
        status = attempt.response.status
        if status >= 400:
            call.completion.status = status
            call.completion.outcome = Outcome.ENGINE_ERROR
            return dialect_for(call.admitted.path).engine_error(status, raw)
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError):
            answer = None
        if not isinstance(answer, dict):
            raise EngineFault(f"answered {status} without a JSON object")
        engine = attempt.engine
        self.wiring.record_served(engine, call.admitted.facts, predicted)
        cached = self.wiring.forwarder.count_cached(engine, UsageTap.of(raw))
        # Connectors keyed by the prompt (vLLM's ExampleConnector, LMCache) hand nothing
        # over: the decode engine finds the KV on its own.
        return Prefilled(engine, answer, cached, predicted, seconds)
