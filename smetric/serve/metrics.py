"""The router's Prometheus metrics, in a registry of its own (several routers per process
in tests, and nothing of the host application's leaks in).

With several router workers (``--workers``), every worker writes its metrics to files in
one directory (prometheus_client's multiprocess mode) and whichever worker takes a scrape
answers with all of them merged: counters and histograms summed over workers, so a
scrape never sees a counter go back. Per-engine gauges are written at scrape time with
every worker's load (the shared load table), so the latest one is the truth; an engine
counts as healthy while no worker holds it ejected.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from smetric.serve.engines import Engine
from smetric.serve.kv_subscriber import KVEventSubscriber, SubscriberCounters

_shared_dir: Path | None = None

_Metric = TypeVar("_Metric", bound=MetricWrapperBase)


def share_metrics_between_processes() -> Path:
    """Make every metric created from now on write to files that all forked workers share
    (call before the router exists); the directory goes when this process exits."""
    global _shared_dir
    if _shared_dir is None:
        _shared_dir = Path(tempfile.mkdtemp(prefix="smetric-metrics-"))
        atexit.register(shutil.rmtree, _shared_dir, True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(_shared_dir)
        # What prometheus_client does at import when that variable is already set.
        values.ValueClass = values.MultiProcessValue()
    return _shared_dir


def forget_process(pid: int) -> None:
    """A worker ended: its live gauges stop counting (its counters still do)."""
    if _shared_dir is not None:
        multiprocess.mark_process_dead(pid, str(_shared_dir))


class RouterMetrics:
    def __init__(self, policy: str, engines: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.shared_dir = _shared_dir
        self._own_collectors: list[Collector] = []
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        self.learned_price = Gauge(
            "smetric_learned_price",
            "Each parameter the routing policy learns online from the engines' replies "
            "(smetric_cost with learn=1: its prices), as it routes with it now; one the "
            "policy spec gave stays as given.",
            ["constant"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.inflight = Gauge(
            "smetric_engine_inflight_requests",
            "Requests routed to the engine whose response has not ended.",
            ["engine"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.unprefilled = Gauge(
            "smetric_engine_unprefilled_tokens",
            "Prompt tokens routed to the engine, less their predicted hits, not yet past "
            "their first token (the prefill_tokens policy's load).",
            ["engine"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.healthy = Gauge(
            "smetric_engine_healthy",
            "1 while the engine passes health checks.",
            ["engine"],
            multiprocess_mode="livemin",
            registry=self.registry,
        )
        self.view_blocks = Gauge(
            "smetric_engine_kv_view_blocks",
            "KV blocks the router believes the engine holds (its device tier).",
            ["engine"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.buffered = Gauge(
            "smetric_buffered_request_bytes",
            "Bytes of request bodies the router holds now, all requests together (what "
            "--max-buffered-bytes caps).",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.decisions = Counter(
            "smetric_routing_decisions",
            "Routing decisions, by the policy branch that made them.",
            ["branch"],
            registry=self.registry,
        )
        self.predicted = Counter(
            "smetric_predicted_hit_tokens",
            "Prompt tokens the router's prefix index expected the engine to have cached.",
            ["engine"],
            registry=self.registry,
        )
        self.reported = Counter(
            "smetric_reported_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens as the engine reported it.",
            ["engine"],
            registry=self.registry,
        )
        self.retries = Counter(
            "smetric_retries",
            "Requests re-routed because an engine failed before the client got any byte.",
            registry=self.registry,
        )
        self.failures = Counter(
            "smetric_engine_failures",
            "Requests an engine failed, by kind: lost (connection refused or cut), timeout, "
            "status (a 5xx), protocol (a reply that is not HTTP).",
            ["engine", "kind"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "smetric_request_seconds",
            "Time from routing to the end of the response.",
            ["api"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.stalls = Counter(
            "smetric_engine_stalls",
            "Times the engine was ejected as stalled: requests in flight, no byte from them "
            "and no progress counter moved for --stall-timeout.",
            ["engine"],
            registry=self.registry,
        )
        self.discovery_errors = Counter(
            "smetric_discovery_errors",
            "Failed DNS lookups of --discover (no answer, an error answer, anything "
            "unexpected): each changes no engine, and the lookups go on.",
            registry=self.registry,
        )
        self.ejections = Counter(
            "smetric_engine_ejections",
            "Times the engine was taken out of rotation: a failed health check, failures in "
            "a row, a lost connection or a stall.",
            ["engine"],
            registry=self.registry,
        )
        self.pd_routed = Counter(
            "smetric_pd_routed",
            "Requests sent to each engine, by leg (prefill or decode).",
            ["leg", "engine"],
            registry=self.registry,
        )
        self.refused = Counter(
            "smetric_refused_requests",
            "Requests the router answered itself, without an engine, by route (other: a "
            "path it does not serve), status and reason (bad_json, not_an_object, "
            "bad_request, body_too_large, prompt_too_long, bad_key, unknown_route, "
            "no_healthy_engine, ...).",
            ["route", "status", "reason"],
            registry=self.registry,
        )
        self.agent_requests = Counter(
            "smetric_agent_requests",
            "Requests by the agent harness that sent them (none: no harness header), the "
            "sender's role (main, subagent, unknown) and call (first, follow_up).",
            ["harness", "role", "call"],
            registry=self.registry,
        )
        self.reads = Counter(
            "smetric_request_reads",
            "Generation bodies by how the router read them: prefix (a kept prefix of an "
            "earlier body and the tail after it), envelope (the top-level fields, messages "
            "raw) or whole (decoded and analysed whole).",
            ["how"],
            registry=self.registry,
        )
        info = Gauge(
            "smetric_router_info",
            "The routing policy.",
            ["policy"],
            registry=self.registry,
            multiprocess_mode="max",
        )
        info.labels(policy).set(1)
        for url in engines:
            self.engine_joined(url, True)

    _PER_ENGINE = (
        "inflight",
        "unprefilled",
        "healthy",
        "view_blocks",
        "predicted",
        "reported",
        "ejections",
        "stalls",
    )

    def engine_joined(self, url: str, healthy: bool) -> None:
        self.healthy.labels(url).set(1 if healthy else 0)
        self.inflight.labels(url).set(0)
        self.unprefilled.labels(url).set(0)
        # Counters start at 0, so a rate over them exists before the first event.
        self.ejections.labels(url)
        self.stalls.labels(url)

    def exposition(self, engines: Iterable[Engine]) -> bytes:
        """The text format, with the engines' gauges read now."""
        for engine in engines:
            self.inflight.labels(engine.url).set(engine.total_inflight())
            self.unprefilled.labels(engine.url).set(engine.total_unprefilled())
            self.view_blocks.labels(engine.url).set(engine.view_blocks())
        if self.shared_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, str(self.shared_dir))
        for collector in self._own_collectors:
            merged.register(collector)
        return generate_latest(merged)

    def register(self, collector: Collector) -> None:
        """A collector read at scrape time in this worker (not a metric of its own)."""
        self.registry.register(collector)
        self._own_collectors.append(collector)

    def child(self, metric: _Metric, *values: str) -> _Metric:
        """``metric.labels(*values)``, kept: ``labels`` takes a lock and builds its key
        on each call, and every request counts itself in several metrics. Label values
        are bounded (engines, branches, known harnesses), and so is what is kept."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def engine_left(self, url: str) -> None:
        """Its series go: a removed engine's last values would read as current."""
        self._children.clear()
        for name in self._PER_ENGINE:
            with contextlib.suppress(KeyError):
                getattr(self, name).remove(url)


class SubscriberCollector(Collector):
    """Exports each KV-event subscriber's state, read at scrape time.

    The subscriber keeps plain values (it is tested without Prometheus); this turns them
    into ``smetric_engine_kv_view_exact{engine}`` and one counter family,
    ``smetric_kv_events_total{engine, kind}``, so gaps, restarts and unrecovered holes are
    visible beside whether the view is still exact.
    """

    def __init__(self, subscribers: Mapping[str, KVEventSubscriber]) -> None:
        self.subscribers = subscribers

    def collect(self) -> Iterator[Metric]:
        exact = GaugeMetricFamily(
            "smetric_engine_kv_view_exact",
            "1 while the engine's KV-event view is exact, 0 when degraded (lost events).",
            labels=["engine"],
        )
        blocks = GaugeMetricFamily(
            "smetric_engine_kv_view_blocks",
            "Blocks the engine's KV-event view holds, all media (at most its max_blocks).",
            labels=["engine"],
        )
        for url, subscriber in self.subscribers.items():
            exact.add_metric([url], 1.0 if subscriber.exact else 0.0)
            blocks.add_metric([url], subscriber.index.blocks)
        yield exact
        yield blocks
        family = CounterMetricFamily(
            "smetric_kv_events",
            "KV-event stream totals per engine: batches, events, gaps, restarts, replayed, "
            "duplicates, unrecovered holes, decode errors, skipped, invalid, orphaned and "
            "mismatched events, unresolved offload hashes, blocks evicted at the cap, resyncs, "
            "subscriber failures.",
            labels=["engine", "kind"],
        )
        for url, subscriber in self.subscribers.items():
            for field in fields(SubscriberCounters):
                family.add_metric([url, field.name], getattr(subscriber.counters, field.name))
        yield family
