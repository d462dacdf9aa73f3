"""Client API keys: every route but ``/health`` needs one when keys are configured.

``/metrics`` names every engine and its load and ``/v1/models`` fans out to every engine,
so both are protected too (``open_paths`` can open ``/metrics`` to a scraper). A key comes
as ``Authorization: Bearer KEY`` (OpenAI's SDKs; the scheme is case-insensitive, as HTTP
says) or ``x-api-key: KEY`` (Anthropic's); a client that sends both is let in when either
is right, so a stale header added by some proxy cannot lock out a good key. Keys are
compared in constant time, each of them, so timing tells nothing about any.

Every front door checks keys here: ``serve``'s routes, and the picker's ``ext_proc``
streams and metrics.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection, Mapping

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from smetric.serve.refusals import Refusal

MISSING_KEY = "missing or invalid API key"


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    """The keys a request carries, in either header (``headers``: aiohttp's, whose
    names match in any case, or lower-cased names as Envoy sends them)."""
    keys = []
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if headers.get("x-api-key", "").strip():
        keys.append(headers["x-api-key"])
    return keys


def _as_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


class KeyCheck:
    """The accepted keys; with none, every request is let in."""

    def __init__(self, accepted: Collection[str]) -> None:
        self.wanted = [_as_bytes(key) for key in accepted]

    def admits(self, headers: Mapping[str, str]) -> bool:
        if not self.wanted:
            return True
        # Every comparison runs, so how long this takes says nothing about the keys.
        matches = [
            hmac.compare_digest(_as_bytes(key), good)
            for key in presented_keys(headers)
            for good in self.wanted
        ]
        return any(matches)

    def middleware(self, open_paths: Collection[str]) -> Middleware:
        """Lets through requests to ``open_paths`` and those with a key; refuses the
        rest (``serve.errors.answer_errors`` answers, in the route's shape)."""

        @web.middleware
        async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path not in open_paths and not self.admits(request.headers):
                raise Refusal(401, "bad_key", MISSING_KEY)
            return await handler(request)

        return check
