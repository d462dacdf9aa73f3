"""``POST /v1/messages/count_tokens``: Anthropic's token count, from an engine when one
serves it, else from the router's own tokenizer.

Agent harnesses ask before they send (Claude Code sizes its context with it), so the
route must answer. An engine counts exactly, with its own template and tokenizer; an
engine that does not serve the route (404, 405, 501), fails or cannot be reached leaves
the count to the router, whose tokenizer and template may differ from the model's. The
``x-smetric-token-count`` header says which one counted: ``engine`` or ``router``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

from smetric.serve.errors import ANTHROPIC
from smetric.serve.forwarding import Forwarder
from smetric.serve.intake import Intake
from smetric.serve.upstream import Attempt, EngineFault

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
TOKEN_COUNT_HEADER = "x-smetric-token-count"
# What an engine answers for a route it does not serve.
_NOT_SERVED = (404, 405, 501)


def declined(status: int) -> bool:
    """An engine's status that leaves the count to the router."""
    return status in _NOT_SERVED or status >= 500


class TokenCounter:
    def __init__(self, intake: Intake, forwarder: Forwarder) -> None:
        self.intake = intake
        self.forwarder = forwarder

    async def answer(self, request: web.Request, raw: bytes) -> web.Response:
        """The count of ``request``, whose body ``raw`` the caller read."""
        decoded, _ = self.intake.body_of(request.headers, raw)
        answer = await self._ask_engine(request, decoded)
        if answer is not None:
            return answer
        count = await self.count(request.headers, raw)
        return web.json_response(count, headers={TOKEN_COUNT_HEADER: "router"})

    async def count(self, headers: Mapping[str, str], raw: bytes) -> dict[str, int]:
        """The router's own count of a request's prompt; raises ``Refusal``."""
        _, body = self.intake.body_of(headers, raw)
        facts = await self.intake.facts_of(body, "messages", large=False)
        return {"input_tokens": facts.prompt_tokens}

    async def _ask_engine(self, request: web.Request, body: bytes) -> web.Response | None:
        """The least loaded healthy engine's answer: its count, or its verdict on a bad
        request; None when it does not serve the route or failed."""
        pool = self.forwarder.pool
        engines = pool.healthy()
        if not engines:
            return None
        engine = min(engines, key=lambda e: e.inflight)
        headers = self.forwarder.upstream_headers(request.headers)
        timeouts = self.forwarder.timeouts
        async with Attempt(
            engine, pool.engine_client(), timeouts, 0, 0, pool.auth(engine)
        ) as attempt:
            try:
                upstream = await attempt.send(COUNT_TOKENS_PATH, body, headers)
                reply = await attempt.read_all()
            except EngineFault:
                return None
        if declined(upstream.status):
            return None
        if upstream.status >= 400:
            return ANTHROPIC.engine_error(upstream.status, reply)
        try:
            count = json.loads(reply)
        except (ValueError, RecursionError):
            return None
        if not isinstance(count, dict) or not isinstance(count.get("input_tokens"), int):
            return None
        return web.json_response(count, headers={TOKEN_COUNT_HEADER: "engine"})
