"""The mock engine's side of vLLM's disaggregated serving (``smetric engine --role``).

What a router sees of vLLM with the NIXL connector, modelled on the mock's real prefix
cache and the simulator's link model:

- A *prefill* engine gets the request with ``max_tokens=1`` and ``kv_transfer_params``
  ``{"do_remote_decode": true}``. When it finishes, vLLM's ``NixlConnector.request_finished``
  keeps the request's blocks (``delay_free_blocks``) and returns the parameters the decode
  side needs: ``do_remote_prefill: true``, ``remote_block_ids``, ``remote_engine_id``,
  ``remote_host``, ``remote_port`` (NIXL's side channel) and ``tp_size``. Here the prompt's
  cached blocks stay pinned until a decode engine pulls them or their lease runs out
  (vLLM frees unclaimed blocks after a timeout as well), and the side channel is this
  engine's own HTTP port (``/smetric/kv/pull``), with ``remote_request_id`` naming the
  transfer.
- A *decode* engine gets the original request with those parameters. Its connector
  (``get_num_new_matched_tokens`` with ``do_remote_prefill``) reads the blocks from the
  prefill engine before the request is scheduled; here the pull takes the link model's
  time (``model.kv.Link``: bandwidth, first come first served), after which the blocks sit
  in the decode engine's prefix cache (``BlockStored`` events included) and the request
  runs with them as a hit. ``cached_tokens`` in its usage then counts them, as vLLM's
  ``num_cached_tokens`` counts externally loaded tokens. Blocks the prefill side no longer
  holds are recomputed, as vLLM recomputes on a failed load.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from smetric.core.conversation import RequestError, RequestFacts
from smetric.core.prefix_cache import Handle
from smetric.engine.scheduler import ROLES, EngineRequest, MockEngine
from smetric.model.kv import Link
from smetric.model.perf import kv_bytes_per_token, load_model

KV_TRANSFER_PARAMS = "kv_transfer_params"
PULL_PATH = "/smetric/kv/pull"


@dataclass
class _Held:
    handle: Handle
    blocks: int
    expires: float


@dataclass
class KVTransfers:
    """One engine's disaggregation state: blocks held for decodes, and its pull link."""

    engine: MockEngine
    role: str
    link_bytes_s: float
    lease_s: float
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    held: dict[str, _Held] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)
    client: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r}: use one of {', '.join(ROLES)}")
        self.link = Link(self.link_bytes_s)
        self.kv_bytes = kv_bytes_per_token(load_model(self.engine.config.model), "bf16")

    async def session(self, app: web.Application) -> AsyncIterator[None]:
        """The HTTP client a decode engine pulls with, for as long as the app runs."""
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        yield
        await self.client.close()

    def check(self, params: Any) -> None:
        """Refuse what this engine's role cannot do, before any work, with a 400."""
        if params is None:
            return
        if not isinstance(params, dict):
            raise RequestError(f"{KV_TRANSFER_PARAMS} must be an object")
        if params.get("do_remote_decode") and self.role == "decode":
            raise RequestError("this is a decode engine: it cannot prefill for a remote decode")
        if params.get("do_remote_prefill") and self.role == "prefill":
            raise RequestError("this is a prefill engine: it cannot decode a remote prefill")

    def hold(self, job: EngineRequest, host: str, port: int) -> dict[str, Any]:
        """Pin the finished prompt's cached blocks for a decode engine; its parameters."""
        self._expire()
        cache = self.engine.pool.cache
        blocks = cache.match(job.blocks)
        transfer = f"{self.engine_id[:8]}-{next(self._ids)}"
        if blocks:
            expires = time.monotonic() + self.lease_s
            self.held[transfer] = _Held(cache.lock(job.blocks, blocks), blocks, expires)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(blocks)),
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": transfer,
            "tp_size": 1,
        }

    def release(self, transfer: str) -> int:
        """A decode engine read the blocks: unpin them; how many there were (0: gone)."""
        self._expire()
        held = self.held.pop(transfer, None)
        if held is None:
            return 0
        self.engine.pool.cache.unlock(held.handle, asyncio.get_running_loop().time())
        return held.blocks

    def _expire(self) -> None:
        now = time.monotonic()
        for transfer in [t for t, h in self.held.items() if h.expires <= now]:
            held = self.held.pop(transfer)
            self.engine.pool.cache.unlock(held.handle, asyncio.get_running_loop().time())

    async def pull(self, facts: RequestFacts, params: dict[str, Any]) -> Handle | None:
        """Read the prompt's blocks from the prefill engine, taking the link's time, and put
        them in this engine's prefix cache; the handle pins them until the request ran."""
        assert self.client is not None
        url = f"http://{params.get('remote_host')}:{params.get('remote_port')}{PULL_PATH}"
        try:
            async with self.client.post(
                url, json={"remote_request_id": params.get("remote_request_id")}
            ) as r:
                blocks = int((await r.json()).get("blocks", 0)) if r.status == 200 else 0
        except (aiohttp.ClientError, TimeoutError, ValueError):
            blocks = 0  # the prefill engine is gone: recompute, as vLLM does on a failed load
        blocks = min(blocks, len(facts.blocks))
        if not blocks:
            return None
        loop = asyncio.get_running_loop()
        nbytes = blocks * self.engine.config.block_size * self.kv_bytes
        done = self.link.transfer(loop.time(), nbytes)
        await asyncio.sleep(max(done - loop.time(), 0.0) * self.engine.config.speed)
        return self.engine.adopt(facts.token_ids, facts.blocks, blocks, loop.time())


TRANSFERS = web.AppKey("kv_transfers", KVTransfers)


async def handle_pull(request: web.Request) -> web.Response:
    """The side channel a decode engine reads a held prompt through."""
    try:
        body = await request.json()
        transfer = str(body["remote_request_id"])
    except (ValueError, KeyError, TypeError):
        return web.json_response({"error": "expected {remote_request_id}"}, status=400)
    return web.json_response({"blocks": request.app[TRANSFERS].release(transfer)})
