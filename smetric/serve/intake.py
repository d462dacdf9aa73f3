"""One request's way in, for every front door (``serve``, ``pick``): the bytes, path and
headers a client sent into what the router routes on, or a ``Refusal``.

Lenient in: the router refuses only what no engine could serve (a body it cannot read, not
JSON, not an object, over ``--max-body-bytes``, a prompt over ``--max-prompt-tokens``, a
body the API's parser finds nothing to route in) and forwards everything else as it came;
the engine judges the rest. Each refusal names the limit or the fault, with a short reason
label for the counter and the log (``serve.refusals``).

A chat or Messages body is read as an envelope with its messages left raw, and a follow-up
is analysed from what it adds (``core.envelope``); any other body, one the envelope cannot
take or finds fault with, and one whose ``kv_transfer_params`` must be dropped, is decoded
and analysed whole, which also words every refusal.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

from smetric.core.conversation import Api, RequestError, RequestFacts
from smetric.core.envelope import Envelope
from smetric.core.parsing import decode_body
from smetric.record.trigger import body_trigger, message_trigger
from smetric.serve.analysis import OFF_LOOP_BYTES, Analyzer
from smetric.serve.backends import without_client_transfer
from smetric.serve.identity import AgentIdentity, identity_of, keyed_by, named_by
from smetric.serve.limits import BodyError, PromptTooLong, body_too_large_message, decoded_body
from smetric.serve.metrics import RouterMetrics
from smetric.serve.refusals import Refusal
from smetric.trace.schema import Trigger

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
    """A request the router will route: its API, the body to forward (decompressed), the
    facts the policy routes on, who sent it, and the top-level fields the router acts on.
    ``rewritten``: the body to forward is not the client's bytes (its
    ``kv_transfer_params`` dropped)."""

    api: Api
    path: str
    raw: bytes
    facts: RequestFacts
    identity: AgentIdentity
    stream: bool
    trigger: Trigger
    # The stored response a Responses request continues, if it names one.
    previous_response_id: str | None
    rewritten: bool = False

    @functools.cached_property
    def body(self) -> dict[str, Any]:
        """The whole body as forwarded, decoded when first asked for: only the legs of a
        disaggregated request need it."""
        body = decode_body(self.raw)
        assert isinstance(body, dict)  # admitted only as a JSON object
        return body


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
        self.analysis_faults = _AnalysisFaults(self)

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
        decoded_raw = self.inflated(headers, raw)
        large = len(decoded_raw) > OFF_LOOP_BYTES
        if self.analyzer.reads_envelope(api):
            sender = named_by(headers)
            hint = f"{sender.harness}:{sender.session}" if sender.session else None
            with self.analysis_faults:
                read = await self.analyzer.analyze_chat(decoded_raw, api, hint, large=large)
            if read is not None and self._forwardable(read[0].envelope):
                chat, facts = read
                envelope = chat.envelope
                metrics = self.metrics
                metrics.child(metrics.reads, "prefix" if chat.known else "envelope").inc()
                return self._admitted(
                    api,
                    path,
                    decoded_raw,
                    self._within_limit(facts),
                    # Headers name a session first; a cache key only where they name none.
                    sender if sender.session else keyed_by(envelope.prompt_cache_key),
                    stream=envelope.stream,
                    trigger=message_trigger(chat.last_message()),
                    previous=envelope.previous_response_id,
                )
        self.metrics.child(self.metrics.reads, "whole").inc()
        body = self._object(decoded_raw)
        forwarded = decoded_raw
        if not self.allow_client_transfer:
            forwarded, body = without_client_transfer(decoded_raw, body)
        facts = await self.facts_of(body, api, large=large)
        return self._admitted(
            api,
            path,
            forwarded,
            facts,
            identity_of(headers, body.get("prompt_cache_key")),
            stream=body.get("stream"),
            trigger=body_trigger(body),
            previous=body.get("previous_response_id"),
            rewritten=forwarded is not decoded_raw,
        )

    def _forwardable(self, envelope: Envelope) -> bool:
        """Whether the body goes to engines as it came: a client's ``kv_transfer_params``
        must be dropped unless allowed, which takes the whole body."""
        return self.allow_client_transfer or not envelope.kv_transfer_params

    def _admitted(
        self,
        api: Api,
        path: str,
        forwarded: bytes,
        facts: RequestFacts,
        identity: AgentIdentity,
        *,
        stream: object,
        trigger: Trigger,
        previous: object,
        rewritten: bool = False,
    ) -> Admitted:
        metrics = self.metrics
        call = identity.call(facts.turn)
        metrics.child(metrics.agent_requests, identity.harness or "none", identity.role, call).inc()
        previous_id = previous if isinstance(previous, str) and previous else None
        return Admitted(
            api, path, forwarded, facts, identity, stream is True, trigger, previous_id, rewritten
        )

    def inflated(self, headers: Mapping[str, str], raw: bytes) -> bytes:
        """The body as sent before its ``Content-Encoding``."""
        try:
            return decoded_body(raw, headers.get("content-encoding", ""), self.max_body_bytes)
        except BodyError as exc:
            raise Refusal(exc.status, _BODY_REASONS.get(exc.status, "bad_body"), str(exc)) from None

    def body_of(self, headers: Mapping[str, str], raw: bytes) -> tuple[bytes, dict[str, Any]]:
        """The body inflated per its ``Content-Encoding``, and its JSON object."""
        decoded_raw = self.inflated(headers, raw)
        return decoded_raw, self._object(decoded_raw)

    def _object(self, body: bytes) -> dict[str, Any]:
        try:
            value = decode_body(body)
        except RequestError as exc:
            raise Refusal(400, "bad_json", str(exc)) from None
        if not isinstance(value, dict):
            raise Refusal(400, "not_an_object", "the request body must be a JSON object")
        return value

    async def facts_of(self, body: dict[str, Any], api: Api, large: bool) -> RequestFacts:
        """The facts of ``body``, its prompt within the token limit."""
        with self.analysis_faults:
            facts = await self.analyzer.analyze(body, api, large=large)
        return self._within_limit(facts)

    def _within_limit(self, facts: RequestFacts) -> RequestFacts:
        limit = self.analyzer.max_prompt_tokens()
        if limit and facts.prompt_tokens > limit:
            raise Refusal(400, "prompt_too_long", self._too_long(f"{facts.prompt_tokens} tokens"))
        return facts

    def _too_long(self, what: str) -> str:
        return f"prompt too long: {what}, over {self.analyzer.prompt_limit()}"


class _AnalysisFaults:
    """A ``with`` block that turns an analysis's faults into refusals; one for every
    request (a class, not a generator, which would be made anew each time)."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    def __enter__(self) -> None:
        pass

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            return
        if isinstance(exc, PromptTooLong):
            raise Refusal(400, "prompt_too_long", self.intake._too_long(str(exc))) from None
        if isinstance(exc, RequestError):
            raise Refusal(400, "bad_request", str(exc)) from None
        if isinstance(exc, TimeoutError | aiohttp.ClientError | OSError | ValueError):
            message = f"tokenising with the engine failed: {exc}"
            raise Refusal(502, "tokenizer_failed", message) from None
