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

Failures. A prefill engine that cannot be reached, fails with a 5xx or stalls past
``prefill_timeout_s`` is left out and the prefill is tried on another, so a client sees
an error only when every prefill engine failed. A decode engine that cannot be reached is
ejected and the same parameters go to another decode engine: the prefill engine still
holds the blocks (vLLM keeps them until read or until its lease runs out), so nothing is
prefilled twice. With no decode engine left the client gets a 503 in OpenAI's error shape.
A decode that sends nothing within ``decode_first_byte_s``, or stalls mid-stream past
``decode_idle_s``, ends with a 504 or an error event and no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from prometheus_client import Counter

from smetric.core.conversation import RequestFacts
from smetric.core.policies import RoundRobin
from smetric.serve.app import Router
from smetric.serve.engines import Engine, QueuedPrefill
from smetric.serve.errors import error_response

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


@dataclass
class DisaggSettings:
    decode_policy: str = "least_kv"
    prefill_timeout_s: float = 300.0
    decode_first_byte_s: float = 300.0
    decode_idle_s: float = 60.0

    def __post_init__(self) -> None:
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(
                f"decode policy {self.decode_policy!r}: use one of {', '.join(DECODE_POLICIES)}"
            )


@dataclass(frozen=True)
class Prefilled:
    """A finished prefill leg: where, what it hands the decode, what it hit, how long."""

    engine: Engine
    params: dict[str, Any] | None
    cached_tokens: int | None
    seconds: float


class _Failed(Exception):
    """This engine failed this leg; ``status`` when it answered with an error."""

    def __init__(self, reason: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(reason)
        self.status = status
        self.body = body


@dataclass
class Disaggregation:
    """Which of the router's engines prefill and which decode, and how each is chosen."""

    prefill_urls: frozenset[str]
    decode_urls: frozenset[str]
    settings: DisaggSettings = field(default_factory=DisaggSettings)
    _turns: RoundRobin = field(default_factory=RoundRobin)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("a disaggregated cluster needs prefill and decode engines")
        if self.prefill_urls & self.decode_urls:
            raise ValueError("an engine cannot be both a prefill and a decode engine")

    def register(self, router: Router) -> None:
        registry = router.metrics.registry
        self.routed = Counter(
            "smetric_pd_routed",
            "Requests sent to each engine, by leg (prefill or decode).",
            ["leg", "engine"],
            registry=registry,
        )
        self.failed = Counter(
            "smetric_pd_failed",
            "Legs that failed on an engine and were tried elsewhere or answered with an error.",
            ["leg", "engine"],
            registry=registry,
        )

    # -- choosing -------------------------------------------------------------------------

    def choose_prefill(
        self, router: Router, facts: RequestFacts, engines: list[Engine]
    ) -> tuple[Engine, int]:
        """The policy's pick, on unprefilled prompt tokens as load (Figure 13, line 29)."""
        return router.route(facts, engines, [float(e.total_unprefilled()) for e in engines])

    def choose_decode(self, router: Router, engines: list[Engine]) -> Engine:
        rule = self.settings.decode_policy
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
        api: str,
        body: dict[str, Any],
        facts: RequestFacts,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Both legs, timed in the router's latency histogram like a colocated request."""
        started = time.perf_counter()
        try:
            return await self._legs(router, request, path, body, facts, headers)
        finally:
            router.metrics.latency.labels(api).observe(time.perf_counter() - started)

    async def _legs(
        self,
        router: Router,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        facts: RequestFacts,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        prefills = [e for e in router.engines if e.url in self.prefill_urls]
        tried: set[str] = set()
        while True:
            candidates = [e for e in prefills if e.healthy and e.url not in tried]
            if not candidates:
                return error_response(
                    503, "no prefill engine could prefill the request", "server_error"
                )
            prefill, predicted = self.choose_prefill(router, facts, candidates)
            tried.add(prefill.url)
            try:
                prefilled = await self._prefill(
                    router, prefill, path, body, facts, predicted, headers
                )
                break
            except _Failed as failure:
                self.failed.labels("prefill", prefill.url).inc()
                router.metrics.retries.inc()
                if failure.status is not None and failure.status < 500:
                    return _passthrough(failure.status, failure.body)  # the request's fault
                log.warning(json.dumps({"event": "prefill_failed", "engine": prefill.url,
                                        "reason": str(failure)}))  # fmt: skip
        decodes = [e for e in router.engines if e.url in self.decode_urls]
        tried.clear()
        params = prefilled.params
        sent = body if params is None else {**body, KV_TRANSFER_PARAMS: params}
        payload = json.dumps(sent).encode()
        while True:
            candidates = [e for e in decodes if e.healthy and e.url not in tried]
            if not candidates:
                return error_response(
                    503, "no decode engine reachable after the prefill", "server_error"
                )
            decode = self.choose_decode(router, candidates)
            tried.add(decode.url)
            self.routed.labels("decode", decode.url).inc()
            decode.inflight += 1
            try:
                return await self._decode(
                    router, request, decode, prefilled, path, payload, headers
                )
            except _Failed as failure:
                self.failed.labels("decode", decode.url).inc()
                router.metrics.retries.inc()
                router._eject(decode, str(failure))
            finally:
                decode.inflight -= 1

    async def _prefill(
        self,
        router: Router,
        engine: Engine,
        path: str,
        body: dict[str, Any],
        facts: RequestFacts,
        predicted: int,
        headers: dict[str, str],
    ) -> Prefilled:
        """Run the prefill leg."""
        assert router.client is not None
        started = time.monotonic()
        queued = QueuedPrefill(engine, facts.prompt_tokens - predicted)
        engine.inflight += 1
        engine.inflight_tokens += facts.prompt_tokens
        self.routed.labels("prefill", engine.url).inc()
        timeout = aiohttp.ClientTimeout(
            total=self.settings.prefill_timeout_s, sock_connect=router.settings.connect_timeout_s
        )
        try:
            async with router.client.post(
                engine.url + path, json=prefill_request(body), headers=headers, timeout=timeout
            ) as response:
                raw = await response.read()
                if response.status != 200:
                    raise _Failed(f"prefill answered {response.status}", response.status, raw)
        except TimeoutError as exc:  # aiohttp's socket timeouts are connection errors too
            raise _Failed(f"prefill stalled past {self.settings.prefill_timeout_s:g} s") from exc
        except aiohttp.ClientConnectionError as exc:
            router._eject(engine, f"prefill connect failed: {exc!r}")
            raise _Failed(f"connect failed: {exc!r}") from exc
        finally:
            engine.inflight -= 1
            engine.inflight_tokens -= facts.prompt_tokens
            queued.done()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        answer = answer if isinstance(answer, dict) else {}
        params = answer.get(KV_TRANSFER_PARAMS)
        # Connectors keyed by the prompt (vLLM's ExampleConnector, LMCache) return none: the
        # decode engine finds the KV on its own.
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        router.prefilled(engine, facts.blocks)
        router.metrics.predicted.labels(engine.url).inc(predicted)
        return Prefilled(
            engine,
            params if isinstance(params, dict) else None,
            cached if isinstance(cached, int) else None,
            time.monotonic() - started,
        )

    async def _decode(
        self,
        router: Router,
        request: web.Request,
        engine: Engine,
        prefilled: Prefilled,
        path: str,
        payload: bytes,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Send the decode leg and relay its answer; ``_Failed`` only before the client
        got anything."""
        assert router.client is not None
        timeout = aiohttp.ClientTimeout(
            sock_connect=router.settings.connect_timeout_s,
            sock_read=self.settings.decode_first_byte_s,
        )
        try:
            upstream = await router.client.post(
                engine.url + path, data=payload, headers=headers, timeout=timeout
            )
        except aiohttp.ConnectionTimeoutError as exc:  # never reached it: try another
            raise _Failed(f"decode connect timed out: {exc!r}") from exc
        except TimeoutError:  # before ClientConnectionError: aiohttp's timeouts are both
            return error_response(
                504, f"decode engine {engine.url} sent nothing in time", "server_error"
            )
        except aiohttp.ClientConnectionError as exc:
            raise _Failed(f"decode connect failed: {exc!r}") from exc
        with contextlib.closing(upstream):
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type or "application/json"
            response.headers[PREFILL_HEADER] = prefilled.engine.url
            response.headers[PREFILL_SECONDS_HEADER] = f"{prefilled.seconds:.6f}"
            if prefilled.cached_tokens is not None:
                response.headers[PREFILL_CACHED_HEADER] = str(prefilled.cached_tokens)
            response.headers[DECODE_HEADER] = engine.url
            await response.prepare(request)
            try:
                while True:
                    chunk = await asyncio.wait_for(
                        upstream.content.readany(), self.settings.decode_idle_s
                    )
                    if not chunk:
                        break
                    await response.write(chunk)
            except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
                log.warning(json.dumps({"event": "decode_broke", "engine": engine.url}))
                message = {
                    "error": {"message": "decode engine stalled or lost", "type": "server_error"}
                }
                if response.content_type == "text/event-stream":
                    with contextlib.suppress(ConnectionResetError):
                        await response.write(f"data: {json.dumps(message)}\n\n".encode())
                return response
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            return response


def _passthrough(status: int, raw: bytes) -> web.Response:
    return web.Response(body=raw, status=status, content_type="application/json")


def disaggregation_from(
    prefill: list[str],
    decode: list[str],
    config: Path | None,
    kv_blocks: int,
    settings: DisaggSettings,
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
        frozenset(e.url for e in prefills), frozenset(e.url for e in decodes), settings
    )
    return engines, disagg
