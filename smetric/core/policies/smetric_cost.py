"""SMetric's cost rule: each request where it would finish soonest, counting what a move costs."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from smetric.core.errors import ConfigError
from smetric.core.policies.base import (
    Choice,
    ClusterView,
    Learner,
    RoutingPolicy,
    RoutingRequest,
)
from smetric.core.policies.ties import TieBreaker, best_hit
from smetric.core.settings import setting


@dataclass(slots=True, kw_only=True)
class SMetricCost(RoutingPolicy):
    """Send each request where it is expected to finish soonest, counting what a move costs.

    SMetric's fixed guard cannot fit every regime: with a global tier a move costs a fetch
    of 0.1-1 s, without one it costs recomputing the prefix (tens of seconds for 100 k
    tokens on an H20, attention being quadratic), so the queue a move must save differs
    by 50x. Here that cost is the threshold: a follow-up leaves the instance holding its
    history only when the time it saves elsewhere exceeds the fetch or recompute there.
    Per instance, in seconds:

    - queue: its unprefilled tokens (``unprefilled_tokens``) at the prefill rate of work
      ``queue_depth`` tokens deep into a prompt;
    - compute: this prompt's prefill beyond what it reuses there, the larger of the
      local hit and the global tier's hit (an unknown global tier counts as empty, so a
      move off a local hit costs a recompute);
    - fetch: what it takes from the global tier beyond its local hit, at ``fetch_tps``;
    - decode: ``output_tokens`` steps, each reading the KV of the instance's in-flight
      prompts (``inflight_prompt_tokens``) at ``kv_read_s`` per token, which is what makes a crowded
      instance slow for every sequence it decodes.

    The work (compute and fetch) counts ``work_weight`` times: once as this request's
    wait, and once more as the wait it passes on to the requests that queue behind it on
    that instance, which near the knee is about as long; counted once, the rule moved
    sessions to recompute them whenever a queue was briefly longer than the recompute,
    and spent the capacity it meant to save (docs/concepts/policies.md).

    Prefilling tokens ``0..n`` takes ``(n + n**2 / (2 * attn_tokens)) / prefill_tps``:
    linear work plus attention over the context so far, which at ``attn_tokens`` of
    context costs as much per token as the rest. The defaults are the simulator's perf
    model for Qwen3-Coder-30B-A3B on one H20 (8 k-token chunks: 14.3 k tokens/s with no
    context, 1.4 k at 100 k; 32 ns per KV token per decode step), a GPU's share of its
    server's NICs (87 GB/s over 8 GPUs at 98 KB a token, ~110 k tokens/s), and WEKA's
    mean output (373 tokens). The simulator derives the four hardware constants (declared
    ``source="hardware"``) the same way for whatever cluster it simulates; an operator of a
    live router passes them in the policy spec. Ties go to the longest local hit, then
    round-robin.

    ``decode_weight`` charges the work once more per request in flight on the instance
    (``inflight_requests``): a prefill runs in the same steps as those requests' decodes,
    so each of them waits about as long again, which is what makes a recompute move fail
    TPOT on fast hardware where the work itself looks cheap
    (docs/results/grid-losses.md). Default 1, the principled value: that whole delay.
    On 32 H20s replaying the whole public WEKA Claude Code capture (637 sessions; the
    repository ships 35), three seeds, it served 0.6-0.8 % more within SLO than 0 with
    and without a global tier (docs/results/grid-losses.md).

    First turns are balanced on ``inflight_prompt_tokens`` (else requests in flight) and
    ignore their cache hit: a first turn decides where a session lives for its next hour
    of turns, so saving a few seconds on a shared system prompt there herds sessions
    (without a global tier that cost several per cent; docs/concepts/policies.md).

    With ``learn=1`` (the default) the hardware constants and ``output_tokens`` that the
    spec does not give are only starting values: its learner, a ``PriceLearner``
    (``prices.py``), takes every completed request the driver sees and the policy takes
    its estimates, so the prices come from what the router observes of its engines, not
    from a model of them. ``learn=0`` keeps them as given or derived.
    """

    name = "smetric_cost"
    ours = True
    branches = ("first_turn_balance", "sticky", "move_fetch", "move_recompute", "evicted")

    # What the hardware sets (``source="hardware"``, each naming the calibrated rate it
    # takes): the simulator derives these from the cluster it simulates
    # (``model.calibrate``); the router takes them from the policy spec. Those and the
    # ``learned`` one are what its learner learns.
    prefill_tps: float = setting(
        14_200.0, "Prefill rate with no context before the chunk, tokens/s.",
        gt=0, lt=math.inf, source="hardware", rate="prefill_tokens_per_s",
    )  # fmt: skip
    attn_tokens: float = setting(
        11_000.0, "Context at which attention costs a token as much as the rest, tokens.",
        gt=0, lt=math.inf, source="hardware", rate="attention_parity_tokens",
    )  # fmt: skip
    fetch_tps: float = setting(
        110_000.0, "Global-tier fetch rate of one instance, tokens/s.",
        gt=0, lt=math.inf, source="hardware", rate="fetch_tokens_per_s",
    )  # fmt: skip
    queue_depth: float = setting(
        50_000.0, "Context depth, tokens, at which queued prefill tokens are priced.", ge=0
    )
    output_tokens: float = setting(
        373.0, "Expected output tokens of a request.", ge=0, source="learned"
    )
    kv_read_s: float = setting(
        3.2e-8, "Decode step time per token of KV read, seconds.",
        ge=0, source="hardware", rate="decode_kv_token_s",
    )  # fmt: skip
    work_weight: float = setting(
        2.0,
        "Times a request's compute and fetch count: its own wait and the wait it passes on.",
        ge=0,
    )
    decode_weight: float = setting(
        1.0, "Times the work counts again per request in flight on the instance.", ge=0
    )
    learn: float = setting(
        1.0,
        "1: learn the hardware and learned constants the spec leaves open from the "
        "requests the router sees (a PriceLearner); 0: keep them.",
        ge=0,
        le=1,
    )
    _queue_s: float = field(default=0.0, init=False, repr=False)
    _decode_s: float = field(default=0.0, init=False, repr=False)
    _ties: TieBreaker = field(default_factory=TieBreaker, init=False, repr=False)

    def __post_init__(self) -> None:
        RoutingPolicy.__post_init__(self)
        if self.learn not in (0.0, 1.0):
            raise ConfigError(f"learn must be 0 or 1, got {self.learn}")

    def derive(self) -> None:
        self._queue_s = (1.0 + self.queue_depth / self.attn_tokens) / self.prefill_tps
        self._decode_s = self.output_tokens * self.kv_read_s

    def learner(self, given: Collection[str] = ()) -> Learner | None:
        """A ``PriceLearner`` started from its constants, never learning those ``given``;
        none with ``learn=0``."""
        if not self.learn:
            return None
        # Here, not at the top: the learner's numpy would load with every command's --help.
        from smetric.core.policies.prices import PriceLearner

        return PriceLearner(self.learnable(), given)

    def prefill_s(self, tokens: float) -> float:
        """Seconds to prefill a prompt's first ``tokens`` tokens from nothing."""
        return (tokens + tokens * tokens / (2.0 * self.attn_tokens)) / self.prefill_tps

    def costs(self, request: RoutingRequest, view: ClusterView) -> list[float]:
        """Each instance's price for this request in seconds: the time it would take to
        finish there, its work counted ``work_weight`` times plus ``decode_weight`` per
        request in flight there."""
        known = view.global_hit_tokens or 0
        whole = self.prefill_s(request.prompt_tokens)
        per_fetch = 1.0 / self.fetch_tps
        queue_s, decode_s, weight = self._queue_s, self._decode_s, self.work_weight
        shared = self.decode_weight
        # Without token counts the decode term is left out: request counts say nothing
        # about the KV a step reads.
        tokens = view.inflight_prompt_tokens or [0.0] * len(view.hit_tokens)
        out = []
        rows = zip(
            view.hit_tokens, view.unprefilled_tokens, tokens, view.inflight_requests, strict=True
        )
        for hit, queued, held, running in rows:
            reuse = max(hit, known)
            work = whole - self.prefill_s(reuse) + (reuse - hit) * per_fetch
            out.append(queued * queue_s + (weight + shared * running) * work + held * decode_s)
        return out

    def route(self, request: RoutingRequest, view: ClusterView) -> Choice:
        if request.turn == 0:
            held = view.inflight_prompt_tokens
            loads = view.inflight_requests if held is None else held
            return Choice(self._ties.argmin(loads), "first_turn_balance")
        costs = self.costs(request, view)
        hits = view.hit_tokens
        target = best_hit(hits, costs)
        if costs[target] > min(costs) or hits[target] == 0:
            target = self._ties.argmin(costs)
        top = max(hits)
        known = view.global_hit_tokens or 0
        if hits[target] == top > 0:
            branch = "sticky"
        elif top == known == 0:
            branch = "evicted"
        elif known >= top:
            branch = "move_fetch"
        else:
            branch = "move_recompute"
        return Choice(target, branch)
