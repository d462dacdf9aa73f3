"""The service-level objectives a request is scored against."""

from __future__ import annotations

from dataclasses import dataclass

from smetric.core.settings import setting


@dataclass(frozen=True)
class SLOConfig:
    """TTFT SLO = ttft_base_s + ttft_per_token_s x input tokens; TPOT SLO fixed.

    Defaults: 1 s plus 0.25 ms per prompt token, about four times what an H20 needs to
    prefill a token of Qwen3-30B-A3B without any cache hit (16.6 k tokens/s measured), so
    a request meets it unless it queues or recomputes far more than its share; 30 ms TPOT
    as in the paper.
    """

    ttft_base_s: float = setting(1.0, "TTFT SLO: seconds allowed to every request.", ge=0)
    ttft_per_token_s: float = setting(0.00025, "TTFT SLO: seconds more per prompt token.", ge=0)
    tpot_s: float = setting(0.030, "TPOT SLO: seconds per output token.", gt=0)
