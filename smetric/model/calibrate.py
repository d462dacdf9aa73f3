"""The hardware rates a cost-based policy prices with, derived from the performance model.

``smetric_cost`` prices queueing, recompute and fetch in seconds, so its constants belong
to the hardware: an H200 prefills about 7x faster than an H20 while a fetch over the
same NICs is only as fast as the KV dtype lets it be, and H20 constants would misprice
every move there. An operator sets them in the policy spec for their engines; the
simulator knows its own hardware and derives them here from the same perf model and
links it simulates, the way the policy's defaults were derived for one H20. A policy takes
a rate for each of its parameters declared ``source="hardware"`` under the rate's name.

Each value is rounded to two significant digits (prefill rate three): they are estimates
of a cost rule, and rounded they are the policy's defaults exactly for the default
cluster, so every result measured with those defaults stands.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from smetric.model.perf import StepTimeModel

# The context depth at which the prefill rate is read to fit the attention term.
_DEEP_CONTEXT_TOKENS = 100_000


def _significant(value: float, digits: int) -> float:
    return float(f"{value:.{digits}g}")


@dataclass(frozen=True)
class HardwareRates:
    """What one instance does per second or per token, named as the policies name them.

    - ``prefill_tps``: the rate of a full chunk (``max_num_batched_tokens``) with no
      context before it;
    - ``attn_tokens``: the context at which attention costs a token as much as the rest,
      fitted so that ``(1 + c / attn_tokens) / prefill_tps`` is a chunk's time per token
      after ``c`` = 100 k tokens of context;
    - ``kv_read_s``: what a decode step spends per token of KV it reads;
    - ``fetch_tps``: tokens of KV a second over the instance's way to the global tier.
    """

    prefill_tps: float
    attn_tokens: float
    kv_read_s: float
    fetch_tps: float

    def as_params(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def hardware_rates(
    perf: StepTimeModel, chunk_tokens: int, fetch_bytes_per_s: float, kv_bytes_per_token: int
) -> HardwareRates:
    """The rates of one instance timed by ``perf`` that prefills ``chunk_tokens`` a step
    and fetches from the global tier at ``fetch_bytes_per_s``."""
    chunk = chunk_tokens
    fresh_tps = chunk / perf.step_time(chunk, chunk * chunk / 2, 0, 0)
    deep_context = chunk * (_DEEP_CONTEXT_TOKENS + chunk / 2)
    deep_tps = chunk / perf.step_time(chunk, deep_context, 0, 0)
    attn_tokens = _DEEP_CONTEXT_TOKENS / (fresh_tps / deep_tps - 1.0)
    return HardwareRates(
        prefill_tps=_significant(fresh_tps, 3),
        attn_tokens=_significant(attn_tokens, 2),
        kv_read_s=_significant(perf.kv_token_s, 2),
        fetch_tps=_significant(fetch_bytes_per_s / kv_bytes_per_token, 2),
    )
