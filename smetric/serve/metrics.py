"""The router's Prometheus metrics, in a registry of its own (several routers per process
in tests, and nothing of the host application's leaks in)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from smetric.serve.kv_subscriber import KVEventSubscriber, SubscriberCounters


class RouterMetrics:
    def __init__(self, policy: str, engines: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.inflight = Gauge(
            "smetric_engine_inflight_requests",
            "Requests routed to the engine whose response has not ended.",
            ["engine"],
            registry=self.registry,
        )
        self.unprefilled = Gauge(
            "smetric_engine_unprefilled_tokens",
            "Prompt tokens routed to the engine, less their predicted hits, not yet past "
            "their first token (the prefill_tokens policy's load).",
            ["engine"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "smetric_engine_healthy",
            "1 while the engine passes health checks.",
            ["engine"],
            registry=self.registry,
        )
        self.view_blocks = Gauge(
            "smetric_engine_kv_view_blocks",
            "KV blocks the router believes the engine holds (its device tier).",
            ["engine"],
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
        info = Gauge(
            "smetric_router_info", "The routing policy.", ["policy"], registry=self.registry
        )
        info.labels(policy).set(1)
        for url in engines:
            self.healthy.labels(url).set(1)
            self.inflight.labels(url).set(0)
            self.unprefilled.labels(url).set(0)


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
        for url, subscriber in self.subscribers.items():
            exact.add_metric([url], 1.0 if subscriber.exact else 0.0)
        yield exact
        family = CounterMetricFamily(
            "smetric_kv_events",
            "KV-event stream totals per engine: batches, events, gaps, restarts, replayed, "
            "duplicates, unrecovered holes, decode errors, skipped, invalid, orphaned and "
            "mismatched events, unresolved offload hashes, resyncs, subscriber failures.",
            labels=["engine", "kind"],
        )
        for url, subscriber in self.subscribers.items():
            for field in fields(SubscriberCounters):
                family.add_metric([url, field.name], getattr(subscriber.counters, field.name))
        yield family
