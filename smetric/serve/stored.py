"""Which engine holds a stored response: asked of the engines each time, never remembered.

A Responses request that names ``previous_response_id`` continues a conversation one
engine stored, and only that engine can serve it; ``GET`` and ``DELETE
/v1/responses/{id}`` likewise. The router keeps no table of ids (any replica must route
any request, and a table would be state to share and lose), so it asks: every healthy
engine at once gets the API's own ``GET /v1/responses/{id}``, and the one that answers 200
holds it. An id no engine holds is the Responses API's 404.

Asking rather than encoding the engine in the id the client sees: an encoded id would make
the router rewrite ids in every reply and every stream, and would have to name engines in a
way all replicas agree on and that survives restarts and DNS changes. Asking costs one
small parallel round trip per such request, works with any engine that serves the API
(vLLM's store included), and finds the response wherever it is, whoever routed it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping, Sequence
from urllib.parse import quote

import aiohttp
from aiohttp import web

from smetric.core.headers import ENGINE_HEADER
from smetric.core.responses_api import response_not_found
from smetric.serve.engines import Engine
from smetric.serve.errors import RESPONSES
from smetric.serve.pool import EnginePool
from smetric.serve.refusals import Refusal

STORED_PATH = "/v1/responses/{id}"
_STORED_PATH = re.compile(r"^/v1/responses/([^/]+)$")


def stored_id(path: str) -> str | None:
    """The response id a ``/v1/responses/{id}`` path names, else None."""
    match = _STORED_PATH.match(path.split("?")[0])
    return match.group(1) if match else None


async def holder(
    pool: EnginePool,
    engines: Sequence[Engine],
    response_id: str,
    headers: Mapping[str, str],
    timeout_s: float,
) -> Engine | None:
    """The one of ``engines`` that holds ``response_id``, asked of all at once; None if
    none answers 200 within ``timeout_s``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def holds(engine: Engine) -> bool:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with pool.client().get(
                _url(engine, response_id), headers=pool.for_engine(engine, headers), timeout=timeout
            ) as response:
                return response.status == 200
        return False

    answers = await asyncio.gather(*(holds(engine) for engine in engines))
    return next((e for e, held in zip(engines, answers, strict=True) if held), None)


async def forward(
    pool: EnginePool,
    engine: Engine,
    request: web.Request,
    headers: Mapping[str, str],
    timeout_s: float,
) -> web.Response:
    """``GET`` or ``DELETE`` of a stored response on the engine that holds it, its answer
    passed on whole (an engine that fails meanwhile is a 502)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    url = _url(engine, request.match_info["id"])
    if request.query_string:
        url += "?" + request.query_string
    try:
        async with pool.client().request(
            request.method, url, headers=pool.for_engine(engine, headers), timeout=timeout
        ) as upstream:
            body = await upstream.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        return RESPONSES.response(502, f"engine {engine.url} failed: {error!r}")
    response = web.Response(body=body, status=upstream.status)
    response.content_type = upstream.content_type or "application/json"
    response.headers[ENGINE_HEADER] = engine.url
    return response


def _url(engine: Engine, response_id: str) -> str:
    return f"{engine.url}/v1/responses/{quote(response_id, safe='')}"


def not_found(response_id: str, param: str | None = None) -> Refusal:
    """No engine holds the response: a 404 in the Responses API's own words."""
    body = response_not_found(response_id, param)
    return Refusal(404, "unknown_response", body["error"]["message"], body)
