"""What an engine says about itself on ``/metrics``, whatever its backend's metric names.

The router's own in-flight count is exact for the traffic it sent, but several router
replicas, or clients that bypass the router, load engines too. A recent scrape of running
plus waiting requests covers that; a stale one is ignored rather than trusted. The
engine's KV pool bounds the router's prefix index better than a configured guess. A
change of the process start time means the engine restarted between two scrapes, perhaps
faster than the health checks could notice, so its cache is gone. The prompt and
generation token counters show whether an engine with requests in flight is working at
all (``serve.pool``'s stall detection). ``serve.backends`` maps each backend's names here.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    # Prompt plus generated tokens the engine has processed since it started.
    progress_tokens: float | None = None

    @property
    def queued(self) -> float | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0.0) + (self.waiting or 0.0)
