"""What a routing policy sees and says.

The simulator and the live router build the same ``ClusterView`` from different sources
and call the same policy object, so a policy never learns which driver called it. Every
decision names the branch that made it, so both drivers can count branches and explain
each routing choice the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, Protocol

from smetric.core.errors import ConfigError
from smetric.core.settings import check_settings


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


class Decision(NamedTuple):
    instance: int
    branch: str


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

    def route(self, request: RoutingRequest, view: ClusterView) -> Decision: ...


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

    @abstractmethod
    def route(self, request: RoutingRequest, view: ClusterView) -> Decision: ...
