"""What a routing policy sees and says, and how policies are named on the command line.

The simulator and the live router build the same ``ClusterView`` from different sources
and call the same policy object, so a policy never learns which driver called it. Every
decision names the branch that made it, so both drivers can count branches and explain
each routing choice the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """The few facts about a request that routing may use; the router keeps no session table."""

    # 0 = first request of a session (no earlier assistant message).
    turn: int
    prompt_tokens: int
    # Prompt tokens of the carried history, excluding the freshly appended part: what an
    # unevicted follow-up should hit on the instance that served its previous turn.
    est_hit_tokens: int
    # Only session hashing reads it.
    session_key: str = ""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Per-instance numbers, indexed alike; lists are the fastest sequences to pass.

    The view is frozen but its sequences are not copied, so a driver may build one view over
    lists it keeps up to date in place and pass that same view on every call.
    """

    # Local-tier prefix hit for this request, in tokens.
    hit_tokens: Sequence[int]
    # In-flight requests (PD colocation) or unprefilled prompt tokens (PD disaggregation).
    load: Sequence[float]
    # Unprefilled prompt tokens queued on the instance (Dynamo's rule): the sum over its
    # requests not yet past their first token of ``prompt_tokens - reusable_hit_tokens``.
    prefill_tokens: Sequence[float]
    # Each instance's number among all the driver's configured instances, when the view
    # holds only some of them (the live router leaves ejected engines out); None: position
    # i is instance i. Session hashing keys on it, so an instance leaving the view moves
    # only its own sessions.
    instance_ids: Sequence[int] | None = None
    # Prompt tokens of the requests in flight; None where the driver does not count them.
    token_load: Sequence[float] | None = None
    # How much of this request's prefix the global tier holds, in tokens; None: unknown.
    global_hit_tokens: int | None = None


def reusable_hit_blocks(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """The leading prompt blocks an instance can take from its cache, given how many it
    holds: never the whole prompt, because vLLM computes at least the last prompt token
    to produce the first output token. The router's prediction, the simulator's view and
    scheduler, and the mock engine all cap a hit this way, so they agree."""
    return min(matched_blocks, max(prompt_tokens - 1, 0) // block_size)


def reusable_hit_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """``reusable_hit_blocks`` in tokens: the hit a policy sees."""
    return reusable_hit_blocks(matched_blocks, prompt_tokens, block_size) * block_size


class Decision(NamedTuple):
    instance: int
    branch: str


class Policy(Protocol):
    """A deterministic map from (request, view) to a decision.

    A policy may hold tiny state (a round-robin pointer), so each driver owns its own object
    and two fresh objects fed the same calls make the same decisions.
    """

    name: str
    # Every branch ``route`` can report, so reports can show zero counts too.
    branches: tuple[str, ...]

    def route(self, request: RoutingRequest, view: ClusterView) -> Decision: ...


POLICY_NAMES: tuple[str, ...] = (
    "smetric",
    "linear",
    "lmetric",
    "least_load",
    "prefill_tokens",
    "round_robin",
    "session_hash",
    "cache_aware",
    "smetric_cost",
)


# What ``smetric serve``, ``demo`` and ``knee`` use unless told otherwise: the policy that
# earned it in the evaluation (README "Evaluation: each policy at its knee").
DEFAULT_POLICY = "smetric_cost"


def _policy_class(name: str) -> type[Policy]:
    # Imported here because the policies build on the types above.
    from smetric.core.policies import POLICY_CLASSES

    try:
        return POLICY_CLASSES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}"
        ) from None


def policy_params(name: str) -> dict[str, float]:
    """The tunable parameters of a policy and their defaults (empty when it has none)."""
    parameters = inspect.signature(_policy_class(name)).parameters.values()
    return {p.name: p.default for p in parameters}


def hardware_params(name: str) -> tuple[str, ...]:
    """The parameters of a policy that depend on the hardware it routes for."""
    return tuple(getattr(_policy_class(name), "hardware_params", ()))


def resolve_policy(
    spec: str, derived: Mapping[str, float] | None = None
) -> tuple[str, dict[str, float]]:
    """A spec's policy name and the value of each of its parameters.

    A parameter takes the spec's value, else ``derived``'s when the policy lists it in
    ``hardware_params`` (constants that depend on the hardware it routes for, which a
    driver that knows the hardware, the simulator, derives), else the class default.
    """
    name, params = spec_params(spec)
    defaults = policy_params(name)
    hardware = hardware_params(name)
    for key, default in defaults.items():
        if key not in params:
            from_hardware = derived is not None and key in hardware and key in derived
            params[key] = float(derived[key]) if from_hardware else default
    return name, params


def spec_params(spec: str) -> tuple[str, dict[str, float]]:
    """A spec's policy name and the parameters it gives, checked against the policy's."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    defaults = policy_params(name)
    params: dict[str, float] = {}
    for item in rest.split(",") if rest.strip() else ():
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq:
            raise ValueError(f"policy {spec!r}: expected key=value, got {item.strip()!r}")
        if key not in defaults:
            valid = ", ".join(defaults) or "none"
            raise ValueError(f"policy {name!r} has no parameter {key!r}; valid: {valid}")
        if key in params:
            raise ValueError(f"policy {spec!r}: parameter {key!r} given twice")
        try:
            params[key] = float(text)
        except ValueError:
            raise ValueError(f"policy {spec!r}: {key}={text!r} is not a number") from None
    return name, params


def make_policy(spec: str, derived: Mapping[str, float] | None = None) -> Policy:
    """A fresh policy from ``name`` or ``name:key=value,key=value``.

    For example ``smetric:overload=1.5,hit_ratio=0.3`` or ``linear:lam=0.95``;
    ``derived`` fills the policy's hardware-derived parameters the spec leaves out
    (``resolve_policy``).
    """
    name, params = resolve_policy(spec, derived)
    return _policy_class(name)(**params)
