"""One request's way in, for every front door (``serve``, ``pick``): the bytes, path and
headers a client sent into what the router routes on, or a ``Refusal``.

Lenient in: the router refuses only what no engine could serve (a body it cannot read, not
JSON, not an object, over ``--max-body-bytes``, a prompt over ``--max-prompt-tokens``, a
body the API's parser finds nothing to route in) and forwards everything else as it came;
the engine judges the rest. Each refusal names the limit or the fault, with a short reason
label for the counter and the log (``serve.refusals``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from smetric.core.conversation import Api, RequestError, RequestFacts
from smetric.core.parsing import decode_body
from smetric.serve.analysis import OFF_LOOP_BYTES, Analyzer
from smetric.serve.backends import without_client_transfer
from smetric.serve.identity import AgentIdentity, identity_of
from smetric.serve.limits import BodyError, PromptTooLong, body_too_large_message, decoded_body
from smetric.serve.metrics import RouterMetrics
from smetric.serve.refusals import Refusal

# The generation routes, and the API each one speaks.
ROUTES: dict[str, Api] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}

_BODY_REASONS = {400: "bad_encoding", 413: "body_too_large", 415: "unsupported_encoding"}


@dataclass(frozen=True)
class Admitted:
    """A request the router will route: its API, the body to forward (decompressed),
    its parsed body, the facts the policy routes on, and who sent it. ``rewritten``: the
    body to forward is not the client's bytes (its ``kv_transfer_params`` dropped)."""

    api: Api
    path: str
    raw: bytes
    body: dict[str, Any]
    facts: RequestFacts
    identity: AgentIdentity
    rewritten: bool = False


class Intake:
    """``allow_client_transfer``: forward clients' ``kv_transfer_params``, which name the
    address an engine reads or sends KV to; else they are dropped (``serve.backends``)."""

    def __init__(
        self,
        analyzer: Analyzer,
        metrics: RouterMetrics,
        max_body_bytes: int,
        allow_client_transfer: bool = False,
    ) -> None:
        self.analyzer = analyzer
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.allow_client_transfer = allow_client_transfer

    def check_size(self, size: int) -> None:
        """Refuse a body of ``size`` bytes before reading the rest of it."""
        if size > self.max_body_bytes:
            raise Refusal(413, "body_too_large", body_too_large_message(self.max_body_bytes))

    async def admit(self, path: str, headers: Mapping[str, str], raw: bytes) -> Admitted:
        """The routed request for a generation route's ``path``; ``headers`` is a
        case-insensitive mapping, or one with lower-case names."""
        api = ROUTES.get(path.split("?")[0])
        if api is None:
            raise Refusal(404, "unknown_route", f"no route {path[:200]!r}")
        decoded, body = self.body_of(headers, raw)
        forwarded = decoded
        if not self.allow_client_transfer:
            forwarded, body = without_client_transfer(decoded, body)
        facts = await self.facts_of(body, api, large=len(decoded) > OFF_LOOP_BYTES)
        identity = identity_of(headers, body)
        self.metrics.agent_requests.labels(
            identity.harness or "none", identity.role, identity.call(facts.turn)
        ).inc()
        return Admitted(api, path, forwarded, body, facts, identity, forwarded is not decoded)

    def body_of(self, headers: Mapping[str, str], raw: bytes) -> tuple[bytes, dict[str, Any]]:
        """The body inflated per its ``Content-Encoding``, and its JSON object."""
        try:
            decoded = decoded_body(raw, headers.get("content-encoding", ""), self.max_body_bytes)
            body = decode_body(decoded)
        except BodyError as exc:
            raise Refusal(exc.status, _BODY_REASONS.get(exc.status, "bad_body"), str(exc)) from None
        except RequestError as exc:
            raise Refusal(400, "bad_json", str(exc)) from None
        if not isinstance(body, dict):
            raise Refusal(400, "not_an_object", "the request body must be a JSON object")
        return decoded, body

    async def facts_of(self, body: dict[str, Any], api: Api, large: bool) -> RequestFacts:
        """The facts of ``body``, its prompt within the token limit."""
        analyzer = self.analyzer
        try:
            facts = await analyzer.analyze(body, api, large=large)
        except PromptTooLong as exc:
            raise Refusal(400, "prompt_too_long", self._too_long(str(exc))) from None
        except RequestError as exc:
            raise Refusal(400, "bad_request", str(exc)) from None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            message = f"tokenising with the engine failed: {exc}"
            raise Refusal(502, "tokenizer_failed", message) from None
        limit = analyzer.max_prompt_tokens()
        if limit and facts.prompt_tokens > limit:
            raise Refusal(400, "prompt_too_long", self._too_long(f"{facts.prompt_tokens} tokens"))
        return facts

    def _too_long(self, what: str) -> str:
        return f"prompt too long: {what}, over {self.analyzer.prompt_limit()}"
