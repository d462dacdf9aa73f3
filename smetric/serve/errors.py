"""Every error the router answers with is OpenAI's JSON error shape, with the right status.

Clients' SDKs parse ``{"error": {"message", "type", "code"}}`` whatever the status; a
plain-text body (aiohttp's default error pages, an engine's or a proxy's own text errors)
reaches the user as an unhelpful decoding failure instead of the message.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from aiohttp.typedefs import Handler

log = logging.getLogger("smetric.serve")


def error_kind(status: int) -> str:
    if status in (401, 403):
        return "authentication_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, kind: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind or error_kind(status), "code": status}}


def error_response(status: int, message: str, kind: str | None = None) -> web.Response:
    """An OpenAI-style error body, so clients' SDKs surface the message."""
    return web.json_response(error_body(status, message, kind), status=status)


def engine_error(status: int, body: bytes) -> web.Response:
    """An engine's error reply for the client: its own JSON error object as it is, any other
    body (a proxy's HTML, a web server's plain text) as the message of one."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return web.json_response(data, status=status)
    text = body.decode("utf-8", "replace").strip()[:1000] or f"the engine answered {status}"
    return error_response(status, f"engine error: {text}")


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (413, 404, 405, a body cut short) and anything
    unexpected answer in OpenAI's shape; an unexpected one is logged with its traceback
    here, never sent to the client."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, "request body too large")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason)
    except web.RequestPayloadError as exc:  # e.g. a chunked body cut short
        return error_response(400, f"cannot read the request body: {exc}")
    except ConnectionResetError:
        raise  # the client went away: nobody to answer
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal router error")
