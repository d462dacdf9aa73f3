"""``smetric serve`` in front of a disaggregated cluster: prefill engines and decode engines.

It speaks the protocol of vLLM's disaggregated serving proxy (the toy proxy in vLLM's
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
here. The decode engine is chosen by ``decode_policy``: ``least_kv`` takes the engine's
scraped ``kv_cache_usage`` where fresh (else its requests in flight), ``least_requests``
the requests in flight, ``round_robin`` turns.

Failures are handled as for colocated engines, each leg on the router's ``try_engines``
(``serve.upstream.Attempt``: the leg's load, the ``first_byte_timeout_s`` and
``idle_timeout_s`` timeouts; passive ejection; OpenAI-style errors). A prefill engine
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
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from prometheus_client import Counter

from smetric.core.conversation import RequestFacts
from smetric.core.policies.ties import TieBreaker
from smetric.serve.app import Delivery, Router, UsageTap
from smetric.serve.engines import Engine
from smetric.serve.errors import engine_error
from smetric.serve.upstream import Attempt, EngineFault

log = logging.getLogger("smetric.serve")

KV_TRANSFER_PARAMS = "kv_transfer_params"
DECODE_POLICIES = ("least_kv", "least_requests", "round_robin")
PREFILL_HEADER = "x-smetric-prefill-engine"
# How long the prefill leg took as the router saw it, and the prompt tokens the prefill
# engine found cached: what ``smetric replay`` measures prefill TTFT and reuse with.
PREFILL_SECONDS_HEADER = "x-smetric-prefill-seconds"
PREFILL_CACHED_HEADER = "x-smetric-prefill-cached-tokens"
DECODE_HEADER = "x-smetric-decode-engine"


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, not streamed, asking the engine to keep the KV."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out[KV_TRANSFER_PARAMS] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


@dataclass(frozen=True)
class Prefilled:
    """A finished prefill leg: where, what it hands the decode, what it hit, how long."""

    engine: Engine
    params: dict[str, Any] | None
    cached_tokens: int | None
    seconds: float

    def tags(self) -> dict[str, str]:
        """The client's headers about this leg, which ``smetric replay`` measures with."""
        tags = {PREFILL_HEADER: self.engine.url, PREFILL_SECONDS_HEADER: f"{self.seconds:.6f}"}
        if self.cached_tokens is not None:
            tags[PREFILL_CACHED_HEADER] = str(self.cached_tokens)
        return tags


@dataclass
class Disaggregation:
    """Which of the router's engines prefill and which decode, and how each is chosen."""

    prefill_urls: frozenset[str]
    decode_urls: frozenset[str]
    decode_policy: str = "least_kv"
    _turns: TieBreaker = field(default_factory=TieBreaker)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("a disaggregated cluster needs prefill and decode engines")
        if self.prefill_urls & self.decode_urls:
            raise ValueError("an engine cannot be both a prefill and a decode engine")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(
                f"decode policy {self.decode_policy!r}: use one of {', '.join(DECODE_POLICIES)}"
            )

    def register(self, router: Router) -> None:
        self.routed = Counter(
            "smetric_pd_routed",
            "Requests sent to each engine, by leg (prefill or decode).",
            ["leg", "engine"],
            registry=router.metrics.registry,
        )

    # -- choosing -------------------------------------------------------------------------

    def choose_prefill(
        self, router: Router, facts: RequestFacts, engines: list[Engine]
    ) -> tuple[Engine, int]:
        """The policy's pick, on unprefilled prompt tokens as load (Figure 13, line 29)."""
        return router.route(facts, engines, [float(e.total_unprefilled()) for e in engines])

    def choose_decode(self, router: Router, engines: list[Engine]) -> Engine:
        rule = self.decode_policy
        now = time.monotonic()

        def measure(engine: Engine) -> float:
            report = engine.report
            fresh = report is not None and now - report.at <= router.settings.staleness_s
            if rule == "least_kv" and fresh and report.kv_usage is not None:
                return report.kv_usage
            return float(engine.inflight)

        if rule == "round_robin":
            engine = engines[self._turns.take(len(engines))]
        else:
            engine = engines[self._turns.argmin([measure(e) for e in engines])]
        log.info(json.dumps({"event": "route_decode", "engine": engine.url, "rule": rule}))
        return engine

    # -- the two legs -----------------------------------------------------------------------

    async def serve(
        self,
        router: Router,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        facts: RequestFacts,
    ) -> web.StreamResponse:
        headers = router.upstream_headers(request)
        prefill_body = json.dumps(prefill_request(body)).encode()

        async def prefill(attempt: Attempt, predicted: int) -> Prefilled | web.Response:
            self.routed.labels("prefill", attempt.engine.url).inc()
            started = time.monotonic()
            await attempt.send(path, prefill_body, headers)
            raw = await router.read_whole(attempt)
            seconds = time.monotonic() - started
            return self._prefilled(router, attempt, raw, facts, predicted, seconds)

        prefilled = await router.try_engines(
            "prefill engine",
            self._pool(router, self.prefill_urls),
            lambda engines: self.choose_prefill(router, facts, engines),
            facts.prompt_tokens,
            prefill,
        )
        if not isinstance(prefilled, Prefilled):
            return prefilled  # no prefill engine could, or the request's own error
        params = prefilled.params
        sent = body if params is None else {**body, KV_TRANSFER_PARAMS: params}
        payload = json.dumps(sent).encode()
        tags = prefilled.tags()

        async def decode(attempt: Attempt, _: int) -> web.StreamResponse:
            self.routed.labels("decode", attempt.engine.url).inc()
            await attempt.send(path, payload, headers)
            delivery = Delivery({**tags, DECODE_HEADER: attempt.engine.url})
            return await router.answer(request, attempt, delivery)

        # The decode engine pulls the prompt's KV: none of it is left to prefill there.
        return await router.try_engines(
            "decode engine",
            self._pool(router, self.decode_urls),
            lambda engines: (self.choose_decode(router, engines), facts.prompt_tokens),
            facts.prompt_tokens,
            decode,
        )

    @staticmethod
    def _pool(router: Router, urls: frozenset[str]) -> list[Engine]:
        return [e for e in router.engines if e.url in urls]

    @staticmethod
    def _prefilled(
        router: Router,
        attempt: Attempt,
        raw: bytes,
        facts: RequestFacts,
        predicted: int,
        seconds: float,
    ) -> Prefilled | web.Response:
        """The prefill engine's whole answer: the request's own error (a 4xx) for the
        client, else the parameters and reuse to hand on."""
        assert attempt.response is not None
        status = attempt.response.status
        if status >= 400:
            return engine_error(status, raw)
        try:
            answer = json.loads(raw)
        except (ValueError, RecursionError):
            answer = None
        if not isinstance(answer, dict):
            raise EngineFault(f"answered {status} without a JSON object")
        engine = attempt.engine
        router.served(engine, facts, predicted)
        cached = router.count_cached(engine, UsageTap.of(raw))
        # Connectors keyed by the prompt (vLLM's ExampleConnector, LMCache) return no
        # parameters: the decode engine finds the KV on its own.
        params = answer.get(KV_TRANSFER_PARAMS)
        return Prefilled(engine, params if isinstance(params, dict) else None, cached, seconds)


def disaggregation_from(
    prefill: list[str],
    decode: list[str],
    config: Path | None,
    kv_blocks: int,
    decode_policy: str,
) -> tuple[list[Engine], Disaggregation] | None:
    """Engines and roles from ``--prefill-engine``/``--decode-engine`` flags and/or the YAML
    keys ``prefill_engines:`` and ``decode_engines:`` (URLs or ``{url, kv_blocks}``);
    None when neither names any, i.e. the cluster is colocated."""
    roles = {"prefill_engines": list(prefill), "decode_engines": list(decode)}
    sized: dict[str, int] = {}
    if config is not None:
        try:
            data = yaml.safe_load(config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"{config}: cannot read YAML: {exc}") from exc
        for key, urls in roles.items():
            entries = data.get(key, []) if isinstance(data, dict) else []
            if not isinstance(entries, list):
                raise ValueError(f"{config}: {key} must be a list of URLs or {{url, kv_blocks}}")
            for entry in entries:
                if isinstance(entry, dict) and isinstance(entry.get("url"), str):
                    sized[entry["url"].rstrip("/")] = int(entry.get("kv_blocks", kv_blocks))
                    entry = entry["url"]
                if not isinstance(entry, str):
                    raise ValueError(f"{config}: each of {key} is a URL or {{url, kv_blocks}}")
                urls.append(entry)
    if not any(roles.values()):
        return None
    prefills, decodes = (
        [Engine(u, kv_blocks) for u in roles[k]] for k in ("prefill_engines", "decode_engines")
    )
    engines = prefills + decodes
    for engine in engines:
        engine.kv_blocks = sized.get(engine.url, kv_blocks)
        engine.forget()  # the prefix index sized to its engine
        if not engine.url.startswith(("http://", "https://")):
            raise ValueError(f"engine {engine.url!r} must be an http(s):// URL")
    disagg = Disaggregation(
        frozenset(e.url for e in prefills), frozenset(e.url for e in decodes), decode_policy
    )
    return engines, disagg
