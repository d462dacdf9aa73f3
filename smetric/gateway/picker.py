"""The picker's decisions and their load, on the router's own routing core.

A request is analysed from its body and routed by the same policy, view and decision log
as ``smetric serve``; only the forwarding is Envoy's. Its load is counted from the pick to
the end of its response, on every exit path, and charged to the engine that actually served
it (Envoy's retries or a fallback may send it elsewhere than picked): when the response
names another engine, its lease moves there (``serve.engines.Lease``, which ``serve``'s
attempts hold too). What the engine cached is read from the response body as it streams
past (``UsageTap``).
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from smetric.core.conversation import RequestFacts
from smetric.core.errors import ConfigError
from smetric.serve.app import Router
from smetric.serve.auth import MISSING_KEY
from smetric.serve.engines import Engine, Lease
from smetric.serve.errors import dialect_for
from smetric.serve.forwarding import Completion, Outcome, UsageTap
from smetric.serve.intake import ROUTES
from smetric.serve.refusals import Refusal
from smetric.serve.stored import holder, not_found, stored_id
from smetric.serve.token_count import COUNT_TOKENS_PATH
from smetric.serve.upstream import EngineFault


@functools.lru_cache(maxsize=4096)
def endpoint_of(url: str) -> str:
    """An engine's ``ip:port`` as the gateway names endpoints (``[v6]:port`` for IPv6);
    ``ConfigError`` unless the URL's host is an IP address, which Envoy connects to as is.
    Cached: every response is matched against every engine's."""
    parts = urlsplit(url)
    try:
        address = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        raise ConfigError(
            f"engine {url!r}: the picker names engines by IP address (ip:port), "
            "so give the engine's IP or discover engines from DNS"
        ) from None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


@dataclass
class Pick:
    """One routed request, from the pick to the end of its response."""

    engine: Engine
    endpoint: str
    api: str
    predicted: int
    facts: RequestFacts | None
    load: Lease
    # What the completion observers (metrics, the recorder) learn once it ends; None for
    # requests that are not generations.
    completion: Completion | None = None
    started: float = field(default_factory=time.perf_counter)
    usage: UsageTap = field(default_factory=UsageTap)
    ok: bool = False
    # Whether the engine caches the request's blocks once it served it: not when it
    # continues a stored response, whose blocks the picker never saw.
    remember: bool = True
    # The body Envoy forwards instead of the client's, inflated (None: the client's own).
    body: bytes | None = None
    # A token count's body, kept in case the engine does not serve the route and the
    # router counts instead.
    count_body: bytes | None = None


class Picker:
    """Decides for Envoy on ``router``'s engines, policy, views and metrics.

    ``max_inflight``: shed (429) a request when every engine it could go to already has
    this many requests in flight (0: never shed).
    """

    def __init__(self, router: Router, max_inflight: int = 0) -> None:
        self.router = router
        self.max_inflight = max_inflight
        for engine in router.engines:
            endpoint_of(engine.url)

    def engine_at(self, endpoint: str) -> Engine | None:
        return next((e for e in self.router.engines if endpoint_of(e.url) == endpoint), None)

    def ready(self) -> bool:
        return any(e.healthy for e in self.router.engines)

    def candidates(self, subset: frozenset[str] | None) -> list[Engine]:
        """Healthy engines, within the gateway's subset hint if it gave one; 503 if none."""
        engines = [
            e
            for e in self.router.engines
            if e.healthy and (subset is None or endpoint_of(e.url) in subset)
        ]
        if not engines:
            within = "" if subset is None else f" among {', '.join(sorted(subset)) or 'none'}"
            message = f"no healthy engine to serve the request{within}"
            raise Refusal(503, "no_healthy_engine", message)
        if self.max_inflight and all(e.inflight >= self.max_inflight for e in engines):
            message = f"every engine has {self.max_inflight} requests in flight"
            raise Refusal(429, "shed", message)
        return engines

    def check_size(self, size: int) -> None:
        self.router.intake.check_size(size)

    def refused(self, path: str, refusal: Refusal) -> dict:
        """The client's answer to ``refusal`` in its API's shape, the refusal noted."""
        self.router.refusals.note(path, refusal)
        if refusal.body is not None:
            return refusal.body
        return dialect_for(path).body(refusal.status, refusal.message)

    def authorize(self, headers: Mapping[str, str]) -> None:
        """A 401 unless ``headers`` carry an accepted key (when the router has keys)."""
        if not self.router.keys.admits(headers):
            raise Refusal(401, "bad_key", MISSING_KEY)

    async def pick(
        self, path: str, headers: Mapping[str, str], raw: bytes, subset: frozenset[str] | None
    ) -> Pick:
        """The engine for one request; raises ``Refusal`` for a request the engines
        should not see (no key, malformed, too large, nothing healthy, shed)."""
        self.authorize(headers)
        api = ROUTES.get(path.split("?")[0])
        engines = self.candidates(subset)
        method = headers.get(":method", "POST")
        response_id = stored_id(path)
        if response_id is not None and method in ("GET", "DELETE"):
            engine = await self._holder(engines, response_id, headers, None)
            return Pick(engine, endpoint_of(engine.url), "other", 0, None, Lease(engine, 0, 0))
        if api is None or method != "POST":
            # Not a generation (/v1/models, /tokenize, ...): nothing to analyse.
            engine = min(engines, key=lambda e: e.inflight)
            count = raw if path.split("?")[0] == COUNT_TOKENS_PATH else None
            lease = Lease(engine, 0, 0)
            return Pick(engine, endpoint_of(engine.url), "other", 0, None, lease, count_body=count)
        admitted = await self.router.intake.admit(path, headers, raw)
        facts, identity = admitted.facts, admitted.identity
        engines = self.candidates(subset)  # health may have changed meanwhile
        completion = Completion(
            admitted.api, path, admitted.stream, facts, identity, admitted.trigger
        )
        previous = admitted.previous_response_id if admitted.api == "responses" else None
        if previous is not None:
            holding = await self._holder(engines, previous, headers, "previous_response_id")
            engine, predicted = self.router.wiring.pin(completion, holding)
        else:
            decision = self.router.wiring.decide(facts, engines, identity=identity)
            engine, predicted = decision.engine, decision.predicted_hit_tokens
            completion.routed = decision.routed()
        load = Lease(engine, facts.prompt_tokens, facts.prompt_tokens - predicted)
        completion.engine = engine.url
        pick = Pick(
            engine, endpoint_of(engine.url), admitted.api, predicted, facts, load, completion
        )
        pick.remember = previous is None
        pick.body = admitted.raw if admitted.rewritten else None
        return pick

    async def _holder(
        self,
        engines: list[Engine],
        response_id: str,
        headers: Mapping[str, str],
        param: str | None,
    ) -> Engine:
        """The engine holding a stored response (``serve.stored``); 404 if none does."""
        passed = self.router.forwarder.upstream_headers(headers)
        timeout = self.router.settings.stream_headers_timeout_s
        engine = await holder(self.router.pool, engines, response_id, passed, timeout)
        if engine is None:
            raise not_found(response_id, param)
        return engine

    def served(
        self,
        pick: Pick,
        endpoint: str | None,
        status: int,
        lost: bool = False,
        retried: bool = False,
    ) -> None:
        """The response's headers: charge the request to the engine that served it, and
        on success record that it now caches the prompt. ``lost``: Envoy could not
        connect to the engine, which is then out at once, as ``serve`` puts it.
        ``retried``: Envoy tried more than once; if another engine served it, the one
        picked could not be reached, and is out at once too."""
        engine = self.engine_at(endpoint) if endpoint else None
        if engine is not None and engine is not pick.engine:
            if retried:
                fault = EngineFault("unreachable through the gateway", lost=True)
                self.router.pool.failed(pick.engine, fault)
            pick.load.move_to(engine)
            pick.engine = engine
            self.router.metrics.retries.inc()
        router = self.router
        if pick.completion is not None:
            pick.completion.engine = pick.engine.url
            pick.completion.status = status
            pick.completion.attempts += 1
        if status >= 500:
            reason = "unreachable through the gateway" if lost else f"answered {status}"
            fault = EngineFault(reason, status=status, lost=lost)
            router.pool.failed(pick.engine, fault)
            return
        router.pool.succeeded(pick.engine)
        if status < 400 and pick.facts is not None:
            pick.ok = True
            if pick.remember:
                router.wiring.record_served(pick.engine, pick.facts, pick.predicted)

    def streamed(self, pick: Pick, chunk: bytes) -> None:
        """A piece of the response passed: the prompt is prefilled by now."""
        pick.load.prefilled()
        pick.usage.feed(chunk)
        completion = pick.completion
        if completion is not None and completion.ttft_s is None and chunk:
            completion.ttft_s = time.perf_counter() - completion.started

    def finished(self, pick: Pick, complete: bool) -> None:
        """The exchange ended (``complete``: the response reached its end). Safe to call
        again."""
        if pick.load.released:
            return
        completion = pick.completion
        if complete and pick.ok:
            cached = self.router.forwarder.count_cached(pick.engine, pick.usage)
            if completion is not None:
                completion.cached_tokens = cached
                completion.output_tokens = pick.usage.output_tokens()
        pick.load.release()
        self.router.metrics.latency.labels(pick.api).observe(time.perf_counter() - pick.started)
        if completion is not None:
            if complete:
                completion.outcome = Outcome.COMPLETED if pick.ok else Outcome.ENGINE_ERROR
            else:  # the stream ended first: the client left, or Envoy reset it
                gone = completion.status != 0
                completion.outcome = Outcome.CLIENT_GONE if gone else Outcome.ENGINE_ERROR
            self.router.forwarder.completed(completion)
