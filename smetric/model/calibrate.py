"""The hardware rates a cost-based policy prices with, derived from the performance model.

``smetric_cost`` prices queueing, recompute and fetch in seconds, so its constants belong
to the hardware: an H200 prefills about 7x faster than an H20 while a fetch over the
same NICs is only as fast as the KV dtype lets it be, and H20 constants would misprice
every move there. An operator sets them in the policy spec for their engines; the
simulator knows its own hardware and derives them here from the same perf model and
links it simulates, the way the policy's defaults were derived for one H20. The rates
are named as the hardware knows them; a policy parameter declared ``source="hardware"``
names the rate it takes (``rate=``), so no policy's names live here.

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
    """What one instance does per second or per token.

    - ``prefill_tokens_per_s``: the rate of a full chunk (``max_num_batched_tokens``) with
      no context before it;
    - ``attention_parity_tokens``: the context at which attention costs a token as much
      as the rest, fitted so that ``(1 + c / attention_parity_tokens) /
      prefill_tokens_per_s`` is a chunk's time per token after ``c`` = 100 k tokens of
      context;
    - ``decode_kv_token_s``: what a decode step spends per token of KV it reads;
    - ``fetch_tokens_per_s``: tokens of KV a second over the instance's way to the global
      tier.
    """

    prefill_tokens_per_s: float
    attention_parity_tokens: float
    decode_kv_token_s: float
    fetch_tokens_per_s: float

    def by_name(self) -> dict[str, float]:
        """Each rate under its name, as policy settings name them (``rate=``)."""
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
    parity = _DEEP_CONTEXT_TOKENS / (fresh_tps / deep_tps - 1.0)
    return HardwareRates(
        prefill_tokens_per_s=_significant(fresh_tps, 3),
        attention_parity_tokens=_significant(parity, 2),
        decode_kv_token_s=_significant(perf.kv_token_s, 2),
        fetch_tokens_per_s=_significant(fetch_bytes_per_s / kv_bytes_per_token, 2),
    )
