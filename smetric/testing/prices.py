"""Engines that follow the price learner's cost model exactly, for its convergence test
and ``benchmarks/price_learning.py``: what a router would observe of every request, given
known constants and noise on every time.

Besides the learned constants they have a fixed 50 ms per first token, queued tokens
that wait 1.5 fresh tokens' time each, decode steps of 5 ms plus the KV read, and half a
fresh token's time per token prefilled beside a stream; 50 ms of Gaussian noise on both
times.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from smetric.core.policies import Observation

# Qwen3-Coder-30B-A3B on one H20 as the simulator's model prices it.
H20_PRICES: dict[str, float] = {
    "prefill_tps": 14_300.0,
    "attn_tokens": 11_000.0,
    "fetch_tps": 110_000.0,
    "kv_read_s": 3.2e-8,
    "output_tokens": 373.0,
}


def model_engines(
    truth: Mapping[str, float], seed: int, fetches: bool = True
) -> Iterator[Observation]:
    """An endless stream of completions: prompts of 2 k-120 k tokens, any part cached,
    40 % of the cached part fetched from the global tier (none when not ``fetches``),
    30 % of requests queued behind up to 20 k tokens."""
    rng = np.random.default_rng(seed)
    per_token = 1.0 / truth["prefill_tps"]
    per_attention = per_token / truth["attn_tokens"]
    while True:
        prompt = int(rng.integers(2_000, 120_000))
        cached = int(rng.integers(0, prompt))
        fetched = fetches and rng.random() < 0.4
        local = int(rng.integers(0, cached + 1)) if fetched else cached
        queued = float(rng.integers(0, 20_000)) if rng.random() < 0.3 else 0.0
        ttft = (
            0.05
            + per_token * (prompt - cached)
            + per_attention * (prompt**2 - cached**2) / 2
            + (cached - local) / truth["fetch_tps"]
            + 1.5 * per_token * queued
        )
        output = int(rng.integers(int(2 * truth["output_tokens"]) - 650, 650))
        tokens = float(rng.integers(10_000, 600_000))
        beside = float(rng.integers(0, 100_000))
        decode = (output - 1) * (0.005 + tokens * truth["kv_read_s"]) + beside * per_token / 2
        yield Observation(
            prompt_tokens=prompt,
            cached_tokens=cached,
            predicted_local_tokens=local,
            queued_tokens=queued,
            ttft_s=max(ttft + rng.normal(0, 0.05), 0.0),
            output_tokens=output,
            decode_s=max(decode + rng.normal(0, 0.05), 0.0),
            decode_tokens=tokens,
            decode_prefill_tokens=beside,
        )


def requests_to_converge(
    values: Iterator[tuple[int, Mapping[str, float]]],
    truth: Mapping[str, float],
    tolerance: float = 0.1,
) -> dict[str, int | None]:
    """Per constant, after how many requests its estimate came within ``tolerance`` of
    ``truth`` for good (None: not by the end), from ``(requests seen, estimates)``."""
    since: dict[str, int | None] = dict.fromkeys(truth)
    for seen, estimates in values:
        for name, want in truth.items():
            if abs(estimates[name] / want - 1) < tolerance:
                since[name] = since[name] or seen
            else:
                since[name] = None
    return since
