"""What engines say about themselves on ``/metrics`` (vLLM's metric names).

The router's own in-flight count is exact for the traffic it sent, but several router
replicas, or clients that bypass the router, load engines too. A recent scrape of
``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` covers that; a stale one is
ignored rather than trusted. ``vllm:cache_config_info`` gives the engine's real KV pool,
which bounds the router's prefix index better than a configured guess. A change of
``process_start_time_seconds`` (Prometheus' process collector, which a single vLLM API
server exposes) means the engine restarted between two scrapes, perhaps faster than the
health checks could notice, so its cache is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EngineReport:
    at: float
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    # Unix time the engine's process started, when it says.
    started_at: float | None = None

    @property
    def queued(self) -> float | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)


def parse_vllm_metrics(text: str, at: float) -> EngineReport:
    """The figures the router uses; summed over label sets (a data-parallel engine has
    one per rank). Raises ValueError on text that is not the Prometheus format."""
    values: dict[str, float] = {}
    blocks: int | None = None
    block_size: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if sample.name == "vllm:cache_config_info":
                blocks = _int(sample.labels.get("num_gpu_blocks"))
                block_size = _int(sample.labels.get("block_size"))
    return EngineReport(
        at=at,
        running=values.get("vllm:num_requests_running"),
        waiting=values.get("vllm:num_requests_waiting"),
        kv_usage=values.get("vllm:kv_cache_usage_perc"),
        num_gpu_blocks=blocks,
        block_size=block_size,
        started_at=values.get("process_start_time_seconds"),
    )


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
