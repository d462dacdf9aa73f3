"""The engine pool: the engines a router routes to, whether each can take traffic, and what
each says about itself.

- **Health.** An active check of ``/health`` every ``health_interval_s``; passive ejection
  of an engine that answers it but fails real requests (``serve.outliers``); a lost
  connection ejects at once. Re-admission waits for the backoff.
- **Scrapes.** ``/metrics`` through the engine's backend (``serve.backends``): load,
  KV pool size, start time (a restart drops the engine's view), progress counters.
- **Stalls.** An engine with requests in flight whose responses bring no byte and whose
  progress counters do not move for ``stall_timeout_s`` is ejected as stalled (a request
  whose client is slow to read its stream is not waiting on the engine), and its
  attempts are cut short (``Attempt.cut``), so those that sent nothing to their clients
  are retried elsewhere. A prefill is silent by nature: it sends no byte until its first
  token, and vLLM counts a prompt's tokens only then (``IterationStats``), so the engine
  is allowed one more second of silence per ``stall_prefill_tps`` prompt tokens routed
  there and not yet prefilled. A non-streaming request cannot be told from a long generation by
  its own bytes, but by the engine's progress it can: while requests are in flight the
  pool scrapes busy engines often enough to see the counters move. An engine whose
  ``/metrics`` answers without progress counters is never judged stalled by bytes alone.
- **Membership.** ``add`` and ``remove`` at runtime (DNS discovery): the engines that stay
  keep their views, numbers and load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable, Mapping

import aiohttp

from smetric.serve.engine_client import EngineClient
from smetric.serve.engines import Engine
from smetric.serve.kv_subscriber import KVEventSubscriber
from smetric.serve.metrics import RouterMetrics
from smetric.serve.outliers import OutlierDetector
from smetric.serve.upstream import EngineFault, with_key

log = logging.getLogger("smetric.serve")


class EnginePool:
    """Engines by URL, in the order they joined; ``start`` runs the checks until ``close``."""

    def __init__(
        self,
        engines: Iterable[Engine],
        metrics: RouterMetrics,
        *,
        block_size: int,
        health_interval_s: float = 2.0,
        connect_timeout_s: float = 5.0,
        scrape_interval_s: float = 0.0,
        staleness_s: float = 5.0,
        stall_timeout_s: float = 20.0,
        stall_prefill_tps: float = 1000.0,
        outliers: OutlierDetector | None = None,
        subscribers: dict[str, KVEventSubscriber] | None = None,
        engine_api_key: str | None = None,
    ) -> None:
        self.metrics = metrics
        self.engine_api_key = engine_api_key
        self.block_size = block_size
        self.health_interval_s = health_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.scrape_interval_s = scrape_interval_s
        self.staleness_s = staleness_s
        self.stall_timeout_s = stall_timeout_s
        if stall_prefill_tps <= 0:
            raise ValueError(f"stall_prefill_tps must be positive, got {stall_prefill_tps}")
        self.stall_prefill_tps = stall_prefill_tps
        self.outliers = outliers or OutlierDetector()
        # KV-event subscribers of the engines that have an events view, by engine URL.
        self.subscribers: dict[str, KVEventSubscriber] = dict(subscribers or {})
        self.engines: list[Engine] = []
        # The longest context each engine's /v1/models reported (0: it reports none).
        self.context_lengths: dict[str, int] = {}
        # Their longest, which caps every prompt: kept, not found per request.
        self._max_context = 0
        self._next_number = 0
        self._client: aiohttp.ClientSession | None = None
        self._engine_client: EngineClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._scraping: set[str] = set()
        for engine in engines:
            self._join(engine)
        if not self.engines:
            raise ValueError("the router needs at least one engine")

    # -- membership ------------------------------------------------------------------------

    def _join(self, engine: Engine) -> None:
        if any(e.url == engine.url for e in self.engines):
            raise ValueError(f"engine {engine.url} is already in the pool")
        engine.number = self._next_number
        self._next_number += 1
        self.engines.append(engine)
        self.metrics.engine_joined(engine.url, engine.healthy)

    def get(self, url: str) -> Engine | None:
        url = url.rstrip("/")
        return next((e for e in self.engines if e.url == url), None)

    def healthy(self, urls: frozenset[str] | None = None) -> list[Engine]:
        """The engines that may take traffic now (of ``urls`` only, if given)."""
        return [e for e in self.engines if e.healthy and (urls is None or e.url in urls)]

    async def add(self, engine: Engine, subscriber: KVEventSubscriber | None = None) -> None:
        """A new engine joins; it gets traffic once its first scrape and check are done."""
        self._join(engine)
        if subscriber is not None:
            self.subscribers[engine.url] = subscriber
            if self._client is not None:
                await subscriber.start()
        if self._client is not None:
            await self.scrape(engine)
            await self.check(engine)

    async def remove(self, url: str) -> Engine | None:
        """The engine leaves: no new traffic; requests already there run to their end."""
        engine = self.get(url)
        if engine is None:
            return None
        self.engines.remove(engine)
        engine.healthy = False
        self._context_length(engine.url, None)
        subscriber = self.subscribers.pop(engine.url, None)
        if subscriber is not None:
            await subscriber.close()
        self.metrics.engine_left(engine.url)
        return engine

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, client: aiohttp.ClientSession, engine_client: EngineClient) -> None:
        """Start with ``client`` for the router's own requests (checks, scrapes, lookups)
        and ``engine_client`` for those it forwards. Subscribe, scrape each engine once (it
        sizes the index to the engine's KV pool before anything is routed there, and the
        start time it reports is what a re-admission compares with to tell a restart from
        a blip), then keep checking."""
        self._client, self._engine_client = client, engine_client
        for subscriber in self.subscribers.values():
            await subscriber.start()
        self._tasks.append(asyncio.create_task(self._check_health_forever()))
        if self.scrape_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._scrape_forever()))
        if self.stall_timeout_s > 0:
            self._tasks.append(asyncio.create_task(self._watch_progress_forever()))
        await asyncio.gather(*(self.scrape(e) for e in self.engines))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks)
        self._tasks.clear()
        for subscriber in self.subscribers.values():
            await subscriber.close()
        self._client = self._engine_client = None

    def client(self) -> aiohttp.ClientSession:
        assert self._client is not None, "the pool is not started"
        return self._client

    def engine_client(self) -> EngineClient:
        assert self._engine_client is not None, "the pool is not started"
        return self._engine_client

    def auth(self, engine: Engine) -> dict[str, str]:
        """The header that gives ``engine`` its key, if it needs one."""
        key = engine.api_key or self.engine_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def for_engine(self, engine: Engine, headers: Mapping[str, str]) -> dict[str, str]:
        """``headers`` as ``engine`` gets them: with its own key, if it needs one, in
        place of any the client sent."""
        return with_key(headers, self.auth(engine))

    def max_context(self) -> int:
        """The longest context an engine reported (0: none yet)."""
        return self._max_context

    def _context_length(self, url: str, length: int | None) -> None:
        """Note an engine's longest context (None: it left)."""
        if length is None:
            self.context_lengths.pop(url, None)
        else:
            self.context_lengths[url] = length
        self._max_context = max(self.context_lengths.values(), default=0)

    # -- passive health ----------------------------------------------------------------------

    def succeeded(self, engine: Engine) -> None:
        self.outliers.succeeded(engine.url)

    def failed(self, engine: Engine, fault: EngineFault) -> None:
        """A lost connection ejects the engine at once (the health check re-admits it when
        it answers again); other failures count towards passive ejection."""
        log.warning(
            json.dumps(
                {
                    "event": "engine_failed",
                    "engine": engine.url,
                    "reason": str(fault),
                    "detail": fault.detail,
                }
            )
        )
        self.metrics.failures.labels(engine.url, fault.kind).inc()
        if fault.stalled:
            return  # already ejected by the stall watcher, with its backoff
        if fault.lost:
            self.eject(engine, str(fault))
            return
        backoff = self.outliers.failed(engine.url, time.monotonic())
        if backoff is not None:
            self.eject(engine, f"{self.outliers.threshold} failures in a row; out {backoff:g} s")

    def eject(self, engine: Engine, reason: str) -> None:
        if engine.healthy:
            log.warning(json.dumps({"event": "eject", "engine": engine.url, "reason": reason}))
            self.metrics.ejections.labels(engine.url).inc()
        engine.healthy = False
        self.metrics.healthy.labels(engine.url).set(0)

    # -- stall detection -----------------------------------------------------------------------

    def stalled(self, engine: Engine, now: float) -> bool:
        """Requests in flight that wait on the engine, no byte from any of them and no
        counter moved for ``stall_timeout_s`` plus the time its unprefilled tokens may
        take; never for an engine whose scrapes answer without counters. A request
        whose client is slow to read waits on its client, not on the engine: whatever
        the engine holds back meanwhile is the client's doing (``Attempt.deliver``)."""
        if not engine.waited_on():
            return False
        if now - engine.progressed_at < self.stall_timeout_s:
            return False
        if now - engine.progressed_at < self.silence_allowed(engine):
            return False
        report = engine.report
        answered_without_counters = (
            report is not None
            and report.progress_tokens is None
            and now - report.at <= self.stall_timeout_s
        )
        return not answered_without_counters

    def silence_allowed(self, engine: Engine) -> float:
        """Seconds ``engine`` may show no progress: the stall timeout, and its prefills'
        time at ``stall_prefill_tps`` (every worker's, which all delay the first tokens)."""
        return self.stall_timeout_s + engine.total_unprefilled() / self.stall_prefill_tps

    async def _watch_progress_forever(self) -> None:
        """Scrape busy engines often enough to see their counters move; eject the stalled."""
        every = max(0.05, min(1.0, self.stall_timeout_s / 4))
        since_scrape: dict[str, float] = {}
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for engine in list(self.engines):
                if not engine.attempts:
                    continue
                if self.stalled(engine, now):
                    self.stall(engine)
                elif now - since_scrape.get(engine.url, 0.0) >= self.stall_timeout_s / 3:
                    since_scrape[engine.url] = now
                    self._scrape_soon(engine)

    def stall(self, engine: Engine) -> None:
        """Eject ``engine`` as stalled for a passive-ejection backoff, and cut its attempts."""
        now = time.monotonic()
        backoff = self.outliers.eject(engine.url, now)
        self.metrics.stalls.labels(engine.url).inc()
        silent = f"no progress for {now - engine.progressed_at:.1f} s"
        self.eject(engine, f"stalled: {silent}; out {backoff:g} s")
        for attempt in list(engine.attempts):
            attempt.cut(f"the engine stalled: {silent}")

    def _scrape_soon(self, engine: Engine) -> None:
        if engine.url in self._scraping:
            return
        self._scraping.add(engine.url)
        task = asyncio.create_task(self.scrape(engine))
        task.add_done_callback(lambda _: self._scraping.discard(engine.url))
        self._tasks.append(task)
        self._tasks = [t for t in self._tasks if not t.done() or t is task]

    # -- active checks -------------------------------------------------------------------------

    async def _check_health_forever(self) -> None:
        while True:
            engines = list(self.engines)
            await asyncio.gather(*(self.check(e) for e in engines))
            unknown = [e for e in engines if e.healthy and e.url not in self.context_lengths]
            await asyncio.gather(*(self.list_models(e) for e in unknown))
            await asyncio.sleep(self.health_interval_s)

    async def check(self, engine: Engine) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s)
            async with self.client().get(engine.url + "/health", timeout=timeout) as response:
                ok = response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if engine not in self.engines:
            return  # removed meanwhile
        now = time.monotonic()
        if ok and not engine.healthy and not self.outliers.may_readmit(engine.url, now):
            return  # answering /health, but failing requests: out until its backoff ends
        if ok and not engine.healthy:
            engine.readmit()
            log.info(json.dumps({"event": "readmit", "engine": engine.url}))
            await self.scrape(engine)  # a restart, if any, shows in its start time
        elif not ok:
            self.eject(engine, "health check failed")
        engine.healthy = ok
        self.metrics.healthy.labels(engine.url).set(1 if ok else 0)

    async def _scrape_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.scrape(e) for e in self.engines if e.healthy))
            await asyncio.sleep(self.scrape_interval_s)

    async def scrape(self, engine: Engine) -> None:
        """Read the engine's /metrics; a failed or garbled scrape just leaves the old one."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s)
            async with self.client().get(engine.url + "/metrics", timeout=timeout) as response:
                text = await response.text()
            report = engine.backend.parse_metrics(text, time.monotonic())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return
        previous = engine.report
        if previous is not None and engine.restarted(report):
            engine.forget()
            log.warning(json.dumps({"event": "engine_restarted", "engine": engine.url}))
            if engine.url in self.subscribers:
                await self.subscribers[engine.url].engine_restarted(since=previous.at)
        if engine.adopt(report, self.block_size):
            log.info(
                json.dumps(
                    {"event": "kv_capacity", "engine": engine.url, "blocks": engine.kv_blocks}
                )
            )

    async def list_models(self, engine: Engine) -> list[dict]:
        """The engine's /v1/models entries (none if it does not answer in time), noting
        the longest context among them, which caps prompts."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.connect_timeout_s)
            async with self.client().get(
                engine.url + "/v1/models", timeout=timeout, headers=self.auth(engine)
            ) as response:
                data = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError, RecursionError):
            return []
        entries = data.get("data") if isinstance(data, dict) else None
        models = [m for m in entries or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if engine in self.engines:
            self._context_length(engine.url, engine.backend.context_length(models))
        return models
