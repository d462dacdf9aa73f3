"""What a routing policy sees, says and hears back.

The simulator and the live router build the same ``ClusterView`` from different sources
and call the same policy object, so a policy never learns which driver called it. Every
decision names the branch that made it, so both drivers can count branches and explain
each routing choice the same way. When a request completes, both drivers tell the same
``Observation`` to the policy's learner, if it has one, and the policy takes what it
learned: a driver knows no policy's parameters.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, Protocol

from smetric.core.errors import ConfigError
from smetric.core.settings import check_settings, settings_of


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
    # Requests in flight on the instance (a live router may raise its own count to what
    # the engine reports queued).
    inflight_requests: Sequence[float]
    # Unprefilled prompt tokens queued on the instance (Dynamo's rule): the sum over its
    # requests not yet past their first token of ``prompt_tokens - reusable_hit_tokens``.
    unprefilled_tokens: Sequence[float]
    # Each instance's number among all the driver's configured instances, when the view
    # holds only some of them (the live router leaves ejected engines out); None: position
    # i is instance i. Session hashing keys on it, so an instance leaving the view moves
    # only its own sessions.
    instance_ids: Sequence[int] | None = None
    # Prompt tokens of the requests in flight; None where the driver does not count them.
    inflight_prompt_tokens: Sequence[float] | None = None
    # How much of this request's prefix the global tier holds, in tokens; None: unknown.
    global_hit_tokens: int | None = None


# The view's counts a policy may balance as the paper's "load": requests in flight (its
# colocated evaluation) or unprefilled prompt tokens (disaggregated prefill, Figure 13
# line 29). A driver tells a policy which one (``make_policy(..., load=...)``).
LOAD_SIGNALS = ("inflight_requests", "unprefilled_tokens")


def load_signal() -> Any:
    """The field of a policy that balances load: which of the view's ``LOAD_SIGNALS``."""
    return field(default="inflight_requests", metadata={"load_signal": True})


def balances_load(cls: type) -> bool:
    """Whether a policy class has a ``load_signal`` field."""
    return any(f.metadata.get("load_signal") for f in fields(cls))


class Choice(NamedTuple):
    """A policy's pick: an index into the view's instances, and the branch that chose it."""

    instance: int
    branch: str


@dataclass(frozen=True, slots=True)
class Observation:
    """What a router knows of one finished request; NaN where it did not see it."""

    prompt_tokens: int
    # As the engine reported them (vLLM: ``usage.prompt_tokens_details.cached_tokens``,
    # which counts what a KV connector loaded too).
    cached_tokens: int
    # The local-tier hit the router predicted where it routed: reported cached tokens
    # beyond it came from the global tier.
    predicted_local_tokens: int
    # Unprefilled prompt tokens queued on that engine when the router sent this one.
    queued_tokens: float
    ttft_s: float
    output_tokens: int
    # First token to last.
    decode_s: float = math.nan
    # Prompt tokens in flight on the engine while it decoded (the mean of what the router
    # counted at its first and last token), and the unprefilled prompt tokens the router
    # sent it in that time.
    decode_tokens: float = math.nan
    decode_prefill_tokens: float = math.nan


class Learner(Protocol):
    """Learns some of a policy's parameters from its completed requests.

    The policy makes its own (``RoutingPolicy.learner``) and keeps none of its state, so
    a policy stays a function of its parameters and the view; the drivers feed it through
    ``Learning``.
    """

    @property
    def observed(self) -> int:
        """How many completed requests it has learned from."""
        ...

    def on_complete(self, done: Observation) -> Mapping[str, float] | None:
        """Take one completed request; the parameters' new values when it has new ones."""
        ...

    def learned(self) -> Mapping[str, float]:
        """Its current values of the parameters it learns."""
        ...


class Policy(Protocol):
    """A deterministic map from (request, view) to a decision.

    A policy may hold tiny state (a round-robin pointer), so each driver owns its own object
    and two fresh objects fed the same calls make the same decisions.
    """

    @property
    def name(self) -> str: ...

    # Every branch ``route`` can report, so reports can show zero counts too.
    @property
    def branches(self) -> tuple[str, ...]: ...

    def route(self, request: RoutingRequest, view: ClusterView) -> Choice: ...


@dataclass(slots=True, kw_only=True)
class RoutingPolicy(ABC):
    """What every policy of the registry declares beside ``route``.

    A policy is a dataclass whose fields declared with ``core.settings.setting`` are its
    parameters: their defaults, help, bounds and sources (tuned by hand, derived from the
    hardware, or learned) are read from there, by the policy spec parser and the commands.
    """

    name: ClassVar[str]
    branches: ClassVar[tuple[str, ...]]
    # True for the policies this project proposes; the rest are the baselines they are
    # compared with.
    ours: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_settings(self)
        load = getattr(self, "load", None)
        if balances_load(type(self)) and load not in LOAD_SIGNALS:
            raise ConfigError(f"load {load!r}: use one of {', '.join(LOAD_SIGNALS)}")
        self.derive()

    @abstractmethod
    def route(self, request: RoutingRequest, view: ClusterView) -> Choice: ...

    def derive(self) -> None:
        """Work out what the policy computes from its parameters once rather than per
        request: when it is made and whenever it is retuned. Nothing by default."""
        return None

    def learner(self, given: Collection[str] = ()) -> Learner | None:
        """What learns this policy's parameters from its completed requests, started from
        their current values and leaving those named in ``given`` (the spec gave them) as
        they are; None, the default, where it learns nothing."""
        return None

    def learning(self, given: Collection[str] = ()) -> Learning | None:
        """What a driver feeds every completed request: this policy with its learner."""
        learner = self.learner(given)
        return None if learner is None else Learning(self, learner)

    def learnable(self) -> dict[str, float]:
        """The current value of each parameter a learner may set: those declared derived
        from the hardware or learned."""
        return {f.name: getattr(self, f.name) for f, meta in settings_of(self) if meta.learnable}

    def retune(self, **values: float) -> None:
        """Take new values of some learnable parameters (a learner's estimates), each
        checked against its declared bounds."""
        declared = {f.name: meta for f, meta in settings_of(self)}
        for name, value in values.items():
            meta = declared.get(name)
            if meta is None or not meta.learnable:
                raise ConfigError(f"{self.name}: {name!r} is not one of its learned parameters")
            setattr(self, name, meta.check(name, value))
        self.derive()


@dataclass(frozen=True, slots=True)
class Learning:
    """A policy and its learner, as a driver holds them: the one thing it tells of each
    completed request (SGLang's ``on_request_complete``, llm-d's ``ResponseComplete``)."""

    policy: RoutingPolicy
    learner: Learner

    def on_complete(self, done: Observation) -> Mapping[str, float] | None:
        """Tell the learner of one completed request; the policy takes whatever new
        values it returns, which are returned for the driver to show."""
        values = self.learner.on_complete(done)
        if values is not None:
            self.policy.retune(**values)
        return values
