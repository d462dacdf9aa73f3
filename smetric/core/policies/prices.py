"""``smetric_cost``'s learner: prices learned from what a router observes, so that a
policy that prices work in seconds needs no model of the engines behind it.

``smetric_cost`` compares queues, recomputes and fetches in seconds; its constants (the
prefill rate, the context depth at which attention doubles a token's cost, the global
tier's fetch rate, the KV read per decode step, the mean output) belong to the engines.
A constant taken from the same performance model that times the simulated engines
would price every move right by construction, which no real router can; taken from a
datasheet it is wrong by whatever the datasheet misses. So the router learns them from
what it sees of every completed request, the same facts in the simulator and in
``smetric serve``:

- time to first token, against the prompt's new tokens, their attention work, the
  tokens fetched from the global tier (reported cached tokens beyond the router's
  predicted local hit) and the unprefilled tokens queued ahead when it was routed;
- the gaps between its streamed tokens, against the prompt tokens in flight on its
  engine while it decoded and the prompt tokens the router sent there meanwhile.

Each is a least-squares fit with non-negative coefficients over a decaying window of
completions, regularised towards the starting values (``prior``) with the weight of a
few requests: a constant whose evidence never arrives (no global tier, so no fetch)
keeps its starting value, and one with evidence follows it. The learner is pure state
fed by the drivers (``base.Learning``); it does no I/O and keeps no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from smetric.core.errors import ConfigError
from smetric.core.policies.base import Observation

# The constants it learns, in the names ``smetric_cost`` takes them.
LEARNABLE = ("prefill_tps", "attn_tokens", "fetch_tps", "kv_read_s", "output_tokens")

# Time to first token = t0 + a*new + b*attention + f*fetched + q*queued, where prefilling
# tokens c..p costs ((p - c) + (p**2 - c**2) / (2 * attn_tokens)) / prefill_tps, so
# a = 1/prefill_tps, b = 1/(prefill_tps * attn_tokens), f = 1/fetch_tps.
# Decode time = (d0 + k*tokens in flight) * steps + w*prefill work routed meanwhile: each
# step's fixed part and the KV it reads (k = kv_read_s), and the prompts that engine
# prefilled in the same steps, which stretch them as much as a crowded KV does; without
# that term the prefill would pass for KV reads wherever load and KV grow together.


# What is left of the prior's weight however many observations came after it.
_PRIOR_FLOOR = 1e-3


class _DecayingFit:
    """Non-negative least squares over a window of observations whose weights decay by
    ``1 - 1/window`` per observation, pulled towards ``prior`` with the weight of
    ``prior_weight`` average observations made before the first (so whatever the units
    of a feature; one no observation has shown keeps its prior)."""

    def __init__(self, prior: np.ndarray, window: float, prior_weight: float) -> None:
        k = len(prior)
        self.keep = 1.0 - 1.0 / window
        self.gram = np.zeros((k, k))
        self.moment = np.zeros(k)
        self.count = 0.0
        self.added = 0
        self.prior_weight = prior_weight
        self.prior = prior.astype(float)
        self.solution = self.prior.copy()

    def add(self, x: np.ndarray, y: float) -> None:
        self.gram *= self.keep
        self.moment *= self.keep
        self.gram += np.outer(x, x)
        self.moment += y * x
        self.count = self.count * self.keep + 1.0
        self.added += 1

    def solve(self) -> np.ndarray:
        """The minimum with every coefficient non-negative."""
        seen = np.diag(self.gram) / self.count if self.count > 0 else np.zeros(len(self.prior))
        # The prior is pseudo-data from before the first observation: it decays as they
        # do (to a floor that keeps features no observation has shown at their prior).
        fading = max(self.keep**self.added, _PRIOR_FLOOR)
        ridge = self.prior_weight * fading * np.where(seen > 0, seen, 1.0)
        gram = self.gram + np.diag(ridge)
        moment = self.moment + ridge * self.prior
        # Solved in units that make the system's diagonal one: the features span fifteen
        # orders of magnitude (a count of one, attention work of 1e10 tokens^2).
        unit = 1.0 / np.sqrt(np.diag(gram))
        self.solution = nonnegative_quadratic(gram * np.outer(unit, unit), moment * unit) * unit
        return self.solution


def nonnegative_quadratic(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """argmin of ``x'Gx/2 - m'x`` over ``x >= 0`` for a positive definite ``G``: Lawson
    and Hanson's active-set method on the normal equations (a handful of variables)."""
    k = len(moment)
    x = np.zeros(k)
    free = np.zeros(k, dtype=bool)
    for _ in range(3 * k):
        gradient = moment - gram @ x
        candidates = np.where(~free & (gradient > 1e-12))[0]
        if not len(candidates):
            break
        free[candidates[np.argmax(gradient[candidates])]] = True
        while True:
            z = np.zeros(k)
            z[free] = np.linalg.solve(gram[np.ix_(free, free)], moment[free])
            if (z[free] > 0).all():
                x = z
                break
            blocked = free & (z <= 0)
            step = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + step * (z - x)
            free &= x > 1e-15
    return x


class PriceLearner:
    """Learns a pricing policy's constants from completed requests.

    ``prior`` holds every constant's starting value; those named in ``fixed`` (a spec
    gave them) are reported as given, never learned. Estimates are refitted every
    ``refit_every`` completions; ``window`` is the number of completions after which an
    observation's weight has decayed by ``1/e``, so the estimates follow engines that
    change (a slower link, a busier neighbour) within about that many requests.
    """

    def __init__(
        self,
        prior: Mapping[str, float],
        fixed: Collection[str] = (),
        *,
        window: float = 1000.0,
        refit_every: int = 16,
        prior_weight: float = 1.0,
    ) -> None:
        missing = [name for name in LEARNABLE if name not in prior]
        if missing:
            raise ConfigError(f"price learner: no starting value for {', '.join(missing)}")
        if window < 1 or refit_every < 1 or prior_weight <= 0:
            raise ConfigError("price learner: window and refit_every >= 1, prior_weight > 0")
        self.prior = {name: float(prior[name]) for name in LEARNABLE}
        self.fixed = frozenset(fixed) & set(LEARNABLE)
        self.refit_every = refit_every
        self.estimates = dict(self.prior)
        self.observed = 0
        rate, attn = self.prior["prefill_tps"], self.prior["attn_tokens"]
        per_token = 1.0 / rate
        self._ttft = _DecayingFit(
            np.array([0.0, per_token, per_token / attn, 1.0 / self.prior["fetch_tps"], 0.0]),
            window,
            prior_weight,
        )
        # The queue's price per token has no prior of its own; it starts at a fresh
        # token's, and nothing exported depends on it.
        self._ttft.prior[4] = per_token
        self._decode = _DecayingFit(
            np.array([0.0, self.prior["kv_read_s"], per_token]), window, prior_weight
        )
        self._keep = 1.0 - 1.0 / window
        self._outputs = 0.0
        self._output_weight = 0.0
        self._dirty = 0

    def on_complete(self, done: Observation) -> dict[str, float] | None:
        """Take one completed request; returns the new estimates when it refitted them."""
        if not done.ttft_s >= 0.0 or done.prompt_tokens <= 0:
            return None  # never reached its first token (rejected, failed)
        prompt = done.prompt_tokens
        cached = min(max(done.cached_tokens, 0), prompt)
        fetched = max(cached - done.predicted_local_tokens, 0)
        x = np.array(
            [
                1.0,
                prompt - cached,
                (prompt * prompt - cached * cached) / 2.0,
                fetched,
                max(done.queued_tokens, 0.0),
            ]
        )
        self._ttft.add(x, done.ttft_s)
        steps = done.output_tokens - 1
        seen = done.decode_s >= 0.0 and done.decode_tokens >= 0.0
        if steps > 0 and seen and done.decode_prefill_tokens >= 0.0:
            x = np.array([steps, steps * done.decode_tokens, done.decode_prefill_tokens])
            self._decode.add(x, done.decode_s)
        if done.output_tokens > 0:
            self._outputs = self._outputs * self._keep + done.output_tokens
            self._output_weight = self._output_weight * self._keep + 1.0
        self.observed += 1
        self._dirty += 1
        if self._dirty < self.refit_every:
            return None
        self._dirty = 0
        return self.refit()

    def refit(self) -> dict[str, float]:
        """Solve both fits now and return every constant's estimate."""
        _, per_token, per_attention, per_fetch, _ = self._ttft.solve()
        _, kv_read, _ = self._decode.solve()
        learned = dict(self.estimates)
        if per_token > 0:
            learned["prefill_tps"] = 1.0 / per_token
            if per_attention > 0:
                learned["attn_tokens"] = per_token / per_attention
        if per_fetch > 0:
            learned["fetch_tps"] = 1.0 / per_fetch
        learned["kv_read_s"] = kv_read
        if self._output_weight > 0:
            learned["output_tokens"] = self._outputs / self._output_weight
        self.estimates = {
            name: self.prior[name] if name in self.fixed else float(value)
            for name, value in learned.items()
        }
        return dict(self.estimates)

    def learned(self) -> dict[str, float]:
        """The estimates of the constants it learns (those no spec fixed)."""
        return {k: v for k, v in self.estimates.items() if k not in self.fixed}
