"""SMetric (paper Figure 13) and the baselines it is compared with, on one code path.

The simulator calls ``route`` tens of thousands of times a second over 32-64 instances, so
the hot paths lean on C-level list scans (``min``, ``max``, ``index``, ``count``) and touch
each instance in Python at most once; for N this small that beats numpy.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from functools import lru_cache

from smetric.core.policy import ClusterView, Decision, Policy, RoutingRequest


def _checked(name: str, value: float, high: float = math.inf) -> float:
    """A parameter in [0, high]; NaN fails the comparison too."""
    if not 0.0 <= value <= high:
        raise ValueError(f"{name} must lie in [0, {high}], got {value}")
    return value


class RoundRobin:
    """A rotating pointer, so that ties (and plain round-robin) spread over instances.

    Always picking the lowest index among equal loads would send every burst of first turns
    on an idle cluster to instance 0; rotating the start spreads them in order.
    """

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def take(self, n: int) -> int:
        """The next instance in cyclic order."""
        chosen = self._next % n
        self._next = chosen + 1
        return chosen

    def argmin(self, values: Sequence[float]) -> int:
        """The first minimum at or after the pointer, wrapping; the pointer moves past it."""
        low = min(values)
        chosen = values.index(low)
        start = self._next % len(values)
        # The pointer is reduced modulo N on use, so a cluster that grows or shrinks is fine.
        if chosen < start and values.count(low) > 1:
            try:  # noqa: SIM105 - contextlib.suppress costs three times as much here
                chosen = values.index(low, start)
            except ValueError:
                pass  # every tie lies before the pointer: wrap to the first
        self._next = chosen + 1
        return chosen


def _positive(name: str, value: float) -> float:
    """A parameter that divides: finite and above zero."""
    if not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def best_hit(hits: Sequence[int], loads: Sequence[float]) -> int:
    """The instance with the longest local hit; ties go to the lower load, then lower index."""
    top = max(hits)
    best = hits.index(top)
    if hits.count(top) > 1:
        for i in range(best + 1, len(hits)):
            if hits[i] == top and loads[i] < loads[best]:
                best = i
    return best


class SMetric:
    """Balance first turns, then stick each session to its cache unless a guard trips.

    The overload guard migrates a session off an instance that grew far hotter than the
    cluster mean; the eviction guard treats a follow-up whose history is mostly gone from
    every local tier as a new session. Both fall back to the same load balancing as turn 0.
    """

    name = "smetric"
    branches = ("first_turn_balance", "sticky", "overload_fallback", "evicted_fallback")
    __slots__ = ("_ties", "hit_ratio", "overload")

    def __init__(self, *, overload: float = 2.0, hit_ratio: float = 0.5) -> None:
        self.overload = _checked("overload", overload)
        self.hit_ratio = _checked("hit_ratio", hit_ratio)
        self._ties = RoundRobin()

    def route(self, request: RoutingRequest, view: ClusterView) -> Decision:
        loads = view.load
        if request.turn == 0:
            return Decision(self._ties.argmin(loads), "first_turn_balance")
        hits = view.hit_tokens
        target = best_hit(hits, loads)
        if loads[target] > self.overload * sum(loads) / len(loads):
            branch = "overload_fallback"
        elif not hits[target] > self.hit_ratio * request.est_hit_tokens:
            branch = "evicted_fallback"
        else:
            return Decision(target, "sticky")
        return Decision(self._ties.argmin(loads), branch)


class SMetricCost:
    """Send each request where it is expected to finish soonest, counting what a move costs.

    SMetric's fixed guard cannot fit every regime: with a global tier a move costs a fetch
    of 0.1-1 s, without one it costs recomputing the prefix (tens of seconds for 100 k
    tokens on an H20, attention being quadratic), so the queue a move must save differs
    by 50x. Here that cost is the threshold: a follow-up leaves the instance holding its
    history only when the time it saves elsewhere exceeds the fetch or recompute there.
    Per instance, in seconds:

    - queue: its unprefilled tokens (``prefill_tokens``) at the prefill rate of work
      ``queue_depth`` tokens deep into a prompt;
    - compute: this prompt's prefill beyond what it reuses there, the larger of the
      local hit and the global tier's hit (an unknown global tier counts as empty, so a
      move off a local hit costs a recompute);
    - fetch: what it takes from the global tier beyond its local hit, at ``fetch_tps``;
    - decode: ``output_tokens`` steps, each reading the KV of the instance's in-flight
      prompts (``token_load``) at ``kv_read_s`` per token, which is what makes a crowded
      instance slow for every sequence it decodes.

    The work (compute and fetch) counts ``work_weight`` times: once as this request's
    wait, and once more as the wait it passes on to the requests that queue behind it on
    that instance, which near the knee is about as long; counted once, the rule moved
    sessions to recompute them whenever a queue was briefly longer than the recompute,
    and spent the capacity it meant to save (README "Routing policies").

    Prefilling tokens ``0..n`` takes ``(n + n**2 / (2 * attn_tokens)) / prefill_tps``:
    linear work plus attention over the context so far, which at ``attn_tokens`` of
    context costs as much per token as the rest. The defaults are the simulator's perf
    model for Qwen3-Coder-30B-A3B on one H20 (8 k-token chunks: 14.3 k tokens/s with no
    context, 1.4 k at 100 k; 32 ns per KV token per decode step), a GPU's share of its
    server's NICs (87 GB/s over 8 GPUs at 98 KB a token, ~110 k tokens/s), and WEKA's
    mean output (373 tokens). The simulator derives the four hardware constants the same
    way for whatever cluster it simulates (``hardware_params``); an operator of a live
    router passes them in the policy spec. Ties go to the longest local hit, then
    round-robin.

    ``decode_weight`` charges the work once more per request in flight on the instance
    (``load``): a prefill runs in the same steps as those requests' decodes, so each of
    them waits about as long again, which is what makes a recompute move fail TPOT on
    fast hardware where the work itself looks cheap (README "Where ``smetric_cost``
    loses"). Default 0: the rule without that term. Only for PD colocation, where
    ``load`` counts requests; a prefill-only pool's ``load`` is tokens.

    First turns are balanced on ``token_load`` alone and ignore their cache hit: a first
    turn decides where a session lives for its next hour of turns, so saving a few
    seconds on a shared system prompt there herds sessions (without a global tier that
    cost several per cent, README "Routing policies").

    With ``learn=1`` (the default) the constants in ``learned_params`` that the spec does
    not give are only starting values: the driver feeds every completed request to a
    ``PriceLearner`` (core/prices.py) and passes its estimates to ``retune``, so the
    prices come from what the router observes of its engines, not from a model of them.
    ``learn=0`` keeps them as given or derived.
    """

    name = "smetric_cost"
    branches = ("first_turn_balance", "sticky", "move_fetch", "move_recompute", "evicted")
    # What the hardware sets: the simulator derives these from the cluster it simulates
    # (sim/calibrate.py); the router takes them from the policy spec.
    hardware_params = ("prefill_tps", "attn_tokens", "fetch_tps", "kv_read_s")
    # What the router learns online when ``learn`` is set (core/prices.py).
    learned_params = (*hardware_params, "output_tokens")
    __slots__ = (
        "_decode_s",
        "_queue_s",
        "_ties",
        "attn_tokens",
        "decode_weight",
        "fetch_tps",
        "kv_read_s",
        "learn",
        "output_tokens",
        "prefill_tps",
        "queue_depth",
        "work_weight",
    )

    def __init__(
        self,
        *,
        prefill_tps: float = 14_200.0,
        attn_tokens: float = 11_000.0,
        fetch_tps: float = 110_000.0,
        queue_depth: float = 50_000.0,
        output_tokens: float = 373.0,
        kv_read_s: float = 3.2e-8,
        work_weight: float = 2.0,
        decode_weight: float = 0.0,
        learn: float = 1.0,
    ) -> None:
        self.queue_depth = _checked("queue_depth", queue_depth)
        self.work_weight = _checked("work_weight", work_weight)
        self.decode_weight = _checked("decode_weight", decode_weight)
        if learn not in (0.0, 1.0):
            raise ValueError(f"learn must be 0 or 1, got {learn}")
        self.learn = learn
        self._ties = RoundRobin()
        self.retune(
            prefill_tps=prefill_tps,
            attn_tokens=attn_tokens,
            fetch_tps=fetch_tps,
            kv_read_s=kv_read_s,
            output_tokens=output_tokens,
        )

    def retune(self, **values: float) -> None:
        """Take new values of some of ``learned_params`` (a learner's estimates)."""
        for name, value in values.items():
            if name not in self.learned_params:
                raise ValueError(f"{self.name}: {name!r} is not one of its learned constants")
            check = _positive if name in ("prefill_tps", "attn_tokens", "fetch_tps") else _checked
            setattr(self, name, check(name, value))
        self._queue_s = (1.0 + self.queue_depth / self.attn_tokens) / self.prefill_tps
        self._decode_s = self.output_tokens * self.kv_read_s

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
        tokens = view.token_load or [0.0] * len(view.hit_tokens)
        out = []
        rows = zip(view.hit_tokens, view.prefill_tokens, tokens, view.load, strict=True)
        for hit, queued, held, running in rows:
            reuse = max(hit, known)
            work = whole - self.prefill_s(reuse) + (reuse - hit) * per_fetch
            out.append(queued * queue_s + (weight + shared * running) * work + held * decode_s)
        return out

    def route(self, request: RoutingRequest, view: ClusterView) -> Decision:
        if request.turn == 0:
            loads = view.load if view.token_load is None else view.token_load
            return Decision(self._ties.argmin(loads), "first_turn_balance")
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
        return Decision(target, branch)


class _Scored:
    """A policy that sends each request to its lowest-scoring instance, ties round-robin."""

    branch = "score"
    __slots__ = ("_ties",)

    def __init__(self) -> None:
        self._ties = RoundRobin()

    def scores(self, request: RoutingRequest, view: ClusterView) -> Sequence[float]:
        raise NotImplementedError

    def route(self, request: RoutingRequest, view: ClusterView) -> Decision:
        return Decision(self._ties.argmin(self.scores(request, view)), self.branch)


class Linear(_Scored):
    """The paper's "Bailian": a weighted sum of normalised load and cache miss ratio.

    Scored as ``(1-lam)*load/max_load - lam*hit/prompt``: the paper's
    ``(1-lam)*load_norm + lam*(1 - hit/prompt)`` less the constant ``lam``, so the same order
    at two fewer operations per instance.
    """

    name = "linear"
    branches = ("score",)
    __slots__ = ("lam",)

    def __init__(self, *, lam: float = 0.9) -> None:
        super().__init__()
        self.lam = _checked("lam", lam, 1.0)

    def scores(self, request: RoutingRequest, view: ClusterView) -> list[float]:
        loads = view.load
        max_load = max(loads)
        per_load = (1.0 - self.lam) / max_load if max_load > 0 else 0.0
        prompt = request.prompt_tokens
        per_hit = self.lam / prompt if prompt > 0 else 0.0
        return [
            per_load * load - per_hit * hit
            for load, hit in zip(loads, view.hit_tokens, strict=True)
        ]


class LMetric(_Scored):
    """LMetric: prefill work left after reuse times (load + 1), with no weight to tune."""

    name = "lmetric"
    branches = ("score",)
    __slots__ = ()

    def scores(self, request: RoutingRequest, view: ClusterView) -> list[float]:
        prompt = request.prompt_tokens
        return [
            (prompt - hit) * (load + 1)
            for hit, load in zip(view.hit_tokens, view.load, strict=True)
        ]


class LeastLoad(_Scored):
    """Load balance only: vLLM's default router and the paper's KV-agnostic baseline."""

    name = "least_load"
    branch = "least_load"
    branches = ("least_load",)
    __slots__ = ()

    def scores(self, request: RoutingRequest, view: ClusterView) -> Sequence[float]:
        return view.load


class PrefillTokens(_Scored):
    """Dynamo: the fewest unprefilled tokens the instance would hold after taking this one."""

    name = "prefill_tokens"
    branches = ("score",)
    __slots__ = ()

    def scores(self, request: RoutingRequest, view: ClusterView) -> list[float]:
        prompt = request.prompt_tokens
        return [
            queued + (prompt - hit)
            for queued, hit in zip(view.prefill_tokens, view.hit_tokens, strict=True)
        ]


class RoundRobinPolicy:
    """Cyclic order, blind to load and cache."""

    name = "round_robin"
    branches = ("round_robin",)
    __slots__ = ("_turns",)

    def __init__(self) -> None:
        self._turns = RoundRobin()

    def route(self, request: RoutingRequest, view: ClusterView) -> Decision:
        return Decision(self._turns.take(len(view.load)), "round_robin")


def highest_random_weight(key: str, instances: Sequence[int]) -> int:
    """The position in ``instances`` of the one that wins ``key`` by rendezvous hashing.

    Each (key, instance number) pair gets a weight and the heaviest instance wins, so
    removing an instance moves only the keys it won, and adding one moves only those it
    now wins (about 1/(n+1) of them). blake2b rather than ``hash()`` so the answer is the
    same in every process, router replicas included.
    """
    base = hashlib.blake2b(key.encode(), digest_size=8)
    owner, top = 0, -1
    for position, instance in enumerate(instances):
        h = base.copy()
        h.update(instance.to_bytes(4, "little"))
        weight = int.from_bytes(h.digest(), "little")
        if weight > top:
            owner, top = position, weight
    return owner


@lru_cache(maxsize=1 << 16)
def rendezvous(key: str, n: int) -> int:
    """The owner of ``key`` among instances ``0..n-1``; memoised because a session asks
    the same question every turn."""
    return highest_random_weight(key, range(n))


class SessionHash:
    """Consistent hashing of the session key: sticky, but blind to load.

    Instances are hashed by their number among all configured instances
    (``ClusterView.instance_ids``), so an instance that leaves the view (an ejected
    engine) moves only its own sessions, and they come back when it returns.
    """

    name = "session_hash"
    branches = ("hash", "no_session_key")
    __slots__ = ("_ties",)

    def __init__(self) -> None:
        self._ties = RoundRobin()

    def route(self, request: RoutingRequest, view: ClusterView) -> Decision:
        key = request.session_key
        if not key:
            return Decision(self._ties.argmin(view.load), "no_session_key")
        ids = view.instance_ids
        if ids is None:
            return Decision(rendezvous(key, len(view.load)), "hash")
        return Decision(highest_random_weight(key, ids), "hash")


class CacheAware:
    """SGLang's router rule: longest match unless the cluster is already imbalanced.

    Imbalance needs both an absolute and a relative gap between the most and least loaded
    instance, so a near-idle cluster with loads 0 and 1 still counts as balanced.
    """

    name = "cache_aware"
    branches = ("imbalance_balance", "cache_hit", "low_match_balance")
    __slots__ = ("_ties", "balance_abs_threshold", "balance_rel_threshold", "cache_threshold")

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: float = 32.0,
        balance_rel_threshold: float = 1.0001,
    ) -> None:
        self.cache_threshold = _checked("cache_threshold", cache_threshold, 1.0)
        self.balance_abs_threshold = _checked("balance_abs_threshold", balance_abs_threshold)
        self.balance_rel_threshold = _checked("balance_rel_threshold", balance_rel_threshold)
        self._ties = RoundRobin()

    def route(self, request: RoutingRequest, view: ClusterView) -> Decision:
        loads = view.load
        high, low = max(loads), min(loads)
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return Decision(self._ties.argmin(loads), "imbalance_balance")
        hits = view.hit_tokens
        target = best_hit(hits, loads)
        # hit/prompt > threshold, written so that an empty prompt is simply no match.
        if hits[target] > self.cache_threshold * request.prompt_tokens:
            return Decision(target, "cache_hit")
        return Decision(self._ties.argmin(loads), "low_match_balance")


POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        SMetric,
        SMetricCost,
        Linear,
        LMetric,
        LeastLoad,
        PrefillTokens,
        RoundRobinPolicy,
        SessionHash,
        CacheAware,
    )
}
