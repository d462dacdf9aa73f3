"""How the simulated engines differ from what the cluster's configuration says they are.

A policy whose prices come from the same performance model that times the engines is
priced right by construction. To see whether a lead survives the model's error bars,
the simulated engines can be made slower, roomier or worse connected than the
configuration describes, while everything a policy is told (its hardware-derived
constants, ``sim/calibrate.py``, which reads the configuration only) stays as
configured: the policy must cope with engines it was not told about, as a router in
front of real ones must.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import msgspec

from smetric.sim.perf import StepTimeModel


@dataclass(frozen=True)
class World:
    """Factors on what the configuration implies; 1 everywhere is the configured world.

    - ``prefill_slowdown``: the prefill part of every engine step takes this many times
      as long (long-context prefill measured slower than the model, say);
    - ``kv_room``: each instance's local KV pool holds this many times the tokens (vLLM's
      memory profile left more or less room than computed);
    - ``tier_bandwidth``: the links to the global tier (PCIe lanes and NICs) carry this
      many times the bytes per second (an LMCache deployment that reaches a fraction of
      line rate end to end);
    - ``free_tier``: see below.
    """

    prefill_slowdown: float = 1.0
    kv_room: float = 1.0
    tier_bandwidth: float = 1.0
    # A global tier that never evicts and moves KV in no time: every reusable token is
    # reused at no cost, which bounds what any router can reach on the cluster.
    free_tier: bool = False

    def __post_init__(self) -> None:
        for name in ("prefill_slowdown", "kv_room", "tier_bandwidth"):
            value = getattr(self, name)
            if not 0.0 < value < float("inf"):
                raise ValueError(f"world: {name} must be positive and finite, got {value}")

    @property
    def nominal(self) -> bool:
        return self == World()


def world_of(data: Any) -> World:
    """A world from a mapping of its factors, every key checked."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of world factors, got {data!r}")
    known = {f.name for f in fields(World)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown world factors {unknown}; known: {sorted(known)}")
    try:
        return msgspec.convert(data, World, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


class SlowerPrefill:
    """A step-time model whose steps' prefill part takes ``factor`` times as long: the
    step less the same step without its prompt chunks, which a decode-only step is."""

    def __init__(self, perf: StepTimeModel, factor: float) -> None:
        self.perf = perf
        self.factor = factor

    @property
    def kv_token_s(self) -> float:
        return self.perf.kv_token_s

    def step_time(
        self,
        prefill_tokens: int,
        prefill_attn_tokens2: float,
        decode_seqs: int,
        decode_context_tokens: int,
    ) -> float:
        step = self.perf.step_time(
            prefill_tokens, prefill_attn_tokens2, decode_seqs, decode_context_tokens
        )
        if prefill_tokens == 0:
            return step
        decode = (
            self.perf.step_time(0, 0.0, decode_seqs, decode_context_tokens) if decode_seqs else 0.0
        )
        return decode + self.factor * (step - decode)


def engine_perf(perf: StepTimeModel, world: World) -> StepTimeModel | SlowerPrefill:
    """The step-time model the simulated engines of ``world`` run at."""
    return perf if world.prefill_slowdown == 1.0 else SlowerPrefill(perf, world.prefill_slowdown)
