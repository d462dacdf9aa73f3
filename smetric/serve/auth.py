"""Client API keys: every route but ``/health`` needs one when keys are configured.

``/metrics`` names every engine and its load and ``/v1/models`` fans out to every engine,
so both are protected too (``open_paths`` can open ``/metrics`` to a scraper). A key comes
as ``Authorization: Bearer KEY`` (OpenAI's SDKs; the scheme is case-insensitive, as HTTP
says) or ``x-api-key: KEY`` (Anthropic's); a client that sends both is let in when either
is right, so a stale header added by some proxy cannot lock out a good key. Keys are
compared in constant time, each of them, so timing tells nothing about any.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from smetric.serve.refusals import Refusal


def presented_keys(request: web.Request) -> list[str]:
    """The keys a request carries, in either header."""
    keys = []
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if request.headers.get("x-api-key", "").strip():
        keys.append(request.headers["x-api-key"])
    return keys


def _as_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def require_key(accepted: Collection[str], open_paths: Collection[str]) -> Middleware:
    """A middleware that lets through requests to ``open_paths`` and those with a key
    (all of them when ``accepted`` is empty)."""
    wanted = [_as_bytes(key) for key in accepted]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if wanted and request.path not in open_paths:
            # Every comparison runs, so how long this takes says nothing about the keys.
            matches = [
                hmac.compare_digest(_as_bytes(key), good)
                for key in presented_keys(request)
                for good in wanted
            ]
            if not any(matches):
                raise Refusal(401, "bad_key", "missing or invalid API key")
        return await handler(request)

    return check
