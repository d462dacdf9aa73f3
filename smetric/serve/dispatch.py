"""Dispatchers: how one analysed request is served by the cluster, behind one protocol.

``Colocated`` sends the request to one engine the policy picks; ``serve.disagg``'s
``Disaggregation`` runs a prefill leg and a decode leg, each the same way. A request's way
reads top to bottom in ``Colocated.dispatch``: decide, open the engine, record what the
engine now holds, relay; an engine that fails before the client got a byte is left out
and the next try decides again (``forwarding.Tries``). Both say for ``/health`` whether
each of their roles has an engine that can serve.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from smetric.core.conversation import RequestFacts
from smetric.core.headers import ENGINE_HEADER, PREDICTED_HIT_HEADER
from smetric.serve.engines import Engine
from smetric.serve.forwarding import Completion, Forwarder
from smetric.serve.identity import ANONYMOUS, AgentIdentity
from smetric.serve.intake import Admitted
from smetric.serve.metrics import RouterMetrics
from smetric.serve.pool import EnginePool
from smetric.serve.routing import Decision, Routed, RoutingCore, explain

log = logging.getLogger("smetric.serve")


@dataclass(frozen=True)
class Call:
    """One request as the router admitted it, and the completion record it fills in."""

    request: web.Request
    admitted: Admitted
    completion: Completion
    # The only engine that can serve it (it holds the stored response a Responses request
    # continues: ``serve.stored``), which the policy then does not choose.
    pinned: Engine | None = None


# The branch of a request sent where its stored response is, not where the policy says.
STORED_BRANCH = "stored_response"


class Dispatcher(Protocol):
    def roles(self) -> dict[str, int]:
        """Healthy engines per role; every role needs one for the router to serve."""
        ...

    async def dispatch(self, call: Call) -> web.StreamResponse: ...


@dataclass
class Wiring:
    """The parts a dispatcher works with."""

    pool: EnginePool
    core: RoutingCore
    forwarder: Forwarder
    metrics: RouterMetrics

    def decide(
        self,
        facts: RequestFacts,
        engines: Sequence[Engine],
        identity: AgentIdentity = ANONYMOUS,
    ) -> Decision:
        """The core's decision, counted and logged (every front door's decisions alike)."""
        decision = self.core.decide(facts, engines)
        metrics = self.metrics
        metrics.child(metrics.decisions, decision.branch).inc()
        if log.isEnabledFor(logging.INFO):  # the line costs more than the decision
            log.info(json.dumps(explain(decision, facts, identity)))
        return decision

    def decide_call(self, call: Call, engines: list[Engine]) -> Decision:
        """``decide`` for a dispatched call, noted in its completion record."""
        decision = self.decide(call.admitted.facts, engines, call.completion.identity)
        call.completion.routed = decision.routed()
        return decision

    def pin(self, completion: Completion, engine: Engine) -> tuple[Engine, int]:
        """The engine holding a request's stored response as its decision, counted and
        logged as decisions are. Nothing is predicted: the router sees only the request's
        new input, not the stored conversation before it."""
        completion.routed = Routed(STORED_BRANCH)
        self.metrics.decisions.labels(STORED_BRANCH).inc()
        if log.isEnabledFor(logging.INFO):
            labels = completion.identity.labels(completion.facts.turn)
            record = {"event": "route", "engine": engine.url, "branch": STORED_BRANCH}
            log.info(json.dumps({**record, **labels}))
        return engine, 0

    def record_served(self, engine: Engine, facts: RequestFacts, predicted: int) -> None:
        """The engine took the request and prefilled it: it now caches the prompt."""
        self.core.served(engine, facts.blocks)
        metrics = self.metrics
        metrics.child(metrics.predicted, engine.url).inc(predicted)


class Colocated:
    """Every engine prefills and decodes; the policy picks one per request."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring

    def roles(self) -> dict[str, int]:
        return {"engine": len(self.wiring.pool.healthy())}

    async def dispatch(self, call: Call) -> web.StreamResponse:
        wiring, forwarder, completion = self.wiring, self.wiring.forwarder, call.completion
        headers = forwarder.upstream_headers(call.request.headers)
        admitted = call.admitted
        tries = forwarder.tries("engine", completion)
        while engines := tries.untried(self.candidates(call)):
            engine, predicted = self.choose(call, engines)
            async with tries.on(engine, admitted.facts.prompt_tokens, predicted) as attempt:
                await attempt.send(admitted.path, admitted.raw, headers, stream=admitted.stream)
                reply = await forwarder.open(attempt, completion)
                # A pinned request's blocks are of its new input alone: not what the
                # engine cached.
                if reply.took and call.pinned is None:
                    wiring.record_served(engine, admitted.facts, predicted)
                tags = {ENGINE_HEADER: engine.url, PREDICTED_HIT_HEADER: str(predicted)}
                return await forwarder.relay(call.request, attempt, reply, tags, completion)
        return tries.given_up()

    def candidates(self, call: Call) -> list[Engine]:
        """The healthy engines, or the one holding the request's stored response."""
        healthy = self.wiring.pool.healthy()
        return healthy if call.pinned is None else [e for e in healthy if e is call.pinned]

    def choose(self, call: Call, engines: list[Engine]) -> tuple[Engine, int]:
        """The engine to try and the prompt tokens it is predicted to hold."""
        if call.pinned is not None:
            return self.wiring.pin(call.completion, call.pinned)
        decision = self.wiring.decide_call(call, engines)
        return decision.engine, decision.predicted_hit_tokens
