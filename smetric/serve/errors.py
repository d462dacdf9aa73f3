"""Every error the router answers with is in the shape of the API the client speaks.

Clients' SDKs parse an error body only in their own API's shape, and a plain-text body
(aiohttp's default error pages, an engine's or a proxy's own text errors) reaches the
user as an unhelpful decoding failure instead of the message. So the route chooses an
``ErrorDialect`` (``dialect_for``), once, for every exit:

- OpenAI chat and completions: ``{"error": {"message", "type", "code"}}``; mid-stream a
  ``data:`` line with the same object, which OpenAI's SDK raises on.
- The Responses API: OpenAI's shape before the headers; mid-stream an ``event: error``
  with ``{"type": "error", "code", "message", "param", "sequence_number"}``.
- Anthropic Messages: ``{"type": "error", "error": {"type", "message"}}``; mid-stream an
  ``event: error`` with the same object (Anthropic streams never carry ``[DONE]``, so
  the event is the only way their SDK learns that a stream failed).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from smetric.serve.refusals import Refusal, RefusalLog

log = logging.getLogger("smetric.serve")

# Anthropic's error types by status (its SDK maps the status to its exception classes).
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


def error_kind(status: int) -> str:
    """OpenAI's error ``type`` for a status."""
    if status in (401, 403):
        return "authentication_error"
    return "server_error" if status >= 500 else "invalid_request_error"


@dataclass(frozen=True)
class ErrorDialect:
    """How one API says that a request failed: before the response's headers (a JSON
    body) and after them (an event that ends the stream)."""

    api: str

    def body(self, status: int, message: str) -> dict[str, Any]:
        if self.api == "anthropic":
            kind = _ANTHROPIC_TYPES.get(
                status, "api_error" if status >= 500 else "invalid_request_error"
            )
            return {"type": "error", "error": {"type": kind, "message": message}}
        return {"error": {"message": message, "type": error_kind(status), "code": status}}

    def response(self, status: int, message: str) -> web.Response:
        return web.json_response(self.body(status, message), status=status)

    def stream_event(self, status: int, message: str, sent_tail: bytes = b"") -> bytes:
        """The event that ends a stream that broke off; ``sent_tail``: the last bytes the
        client got (the Responses API numbers its events, the error included)."""
        if self.api == "responses":
            numbers = _SEQUENCE.findall(sent_tail)
            event = {
                "type": "error",
                "code": error_kind(status),
                "message": message,
                "param": None,
                "sequence_number": int(numbers[-1]) + 1 if numbers else 0,
            }
            return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
        data = json.dumps(self.body(status, message))
        if self.api == "anthropic":
            return f"event: error\ndata: {data}\n\n".encode()
        return f"data: {data}\n\n".encode()

    def engine_error(self, status: int, body: bytes) -> web.Response:
        """An engine's error reply for the client: its own JSON error object as it is
        when it is in this API's shape; in the other shape (an engine answering Anthropic's
        route with OpenAI's error object, as some vLLM releases do) its message in this
        one, so the client's SDK reads it; any other body (a proxy's HTML, a web server's
        plain text) as the message of one."""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            if (data.get("type") == "error") == (self.api == "anthropic"):
                return web.json_response(data, status=status)
            message = data["error"].get("message")
            if isinstance(message, str):
                return self.response(status, message)
            return web.json_response(data, status=status)
        text = body.decode("utf-8", "replace").strip()[:1000] or f"the engine answered {status}"
        return self.response(status, f"engine error: {text}")


OPENAI = ErrorDialect("openai")
RESPONSES = ErrorDialect("responses")
ANTHROPIC = ErrorDialect("anthropic")


def dialect_for(path: str) -> ErrorDialect:
    """The dialect of the API a path belongs to; OpenAI's for any other path."""
    path = path.split("?")[0]
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        return RESPONSES
    return OPENAI


def _refusal_of(request: web.Request, exc: web.HTTPException, max_body_bytes: int) -> Refusal:
    """aiohttp's own refusals, said as the router's."""
    if exc.status == 413:
        return body_too_large(max_body_bytes)
    if exc.status == 404:
        return Refusal(404, "unknown_route", f"no route {request.path[:200]!r}")
    if exc.status == 405:
        return Refusal(405, "method_not_allowed", "method not allowed on this route")
    return Refusal(exc.status, "http_error", exc.reason)


def body_too_large(max_body_bytes: int) -> Refusal:
    return Refusal(
        413,
        "body_too_large",
        f"request body too large: over --max-body-bytes ({max_body_bytes} bytes)",
    )


def answer_errors(refusals: RefusalLog, max_body_bytes: int) -> Middleware:
    """A middleware that answers every refusal (the router's, aiohttp's 404, 405 and
    413, a body cut short) and anything unexpected in the route's dialect, counting and
    logging the refusals; an unexpected error is logged with its traceback here, never
    sent to the client."""

    @web.middleware
    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refusal as refusal:
            response = refused(request.path, refusal, refusals)
            if refusal.status == 408 and request.transport is not None:
                # Nor is the rest of so slow a body waited for (aiohttp would linger,
                # reading it, 10 s more): the answer goes, and the connection with it.
                await response.prepare(request)
                await response.write_eof()
                request.transport.close()
            return response
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return refused(request.path, _refusal_of(request, exc, max_body_bytes), refusals)
        except web.RequestPayloadError as exc:  # e.g. a chunked body cut short
            unreadable = Refusal(400, "unreadable_body", f"cannot read the request body: {exc}")
            return refused(request.path, unreadable, refusals)
        except ConnectionResetError:
            raise  # the client went away: nobody to answer
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            return dialect_for(request.path).response(500, "internal router error")

    return answer


def refused(path: str, refusal: Refusal, refusals: RefusalLog) -> web.Response:
    """The client's answer to ``refusal``, noted."""
    refusals.note(path, refusal)
    if refusal.body is not None:
        response = web.json_response(refusal.body, status=refusal.status)
    else:
        response = dialect_for(path).response(refusal.status, refusal.message)
    if refusal.retry_after_s is not None:
        response.headers["Retry-After"] = str(refusal.retry_after_s)
    return response
