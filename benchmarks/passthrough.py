"""The least a router on SMetric's server stack can do: read the body, post it to an
engine (each in turn), return the reply (a stream chunk by chunk as it arrives). Nothing
parsed, nothing decided, nothing logged, so a benchmark through it measures aiohttp
itself, the floor under ``smetric serve``.

    python benchmarks/passthrough.py PORT WORKERS ENGINE_URL...
                                     [--protocol-relay | --protocol-reads]

PORT 0 takes a free one; the startup line ("... on http://127.0.0.1:PORT") names it.
WORKERS processes share the listening socket, as ``smetric serve --workers`` does.

``--protocol-relay`` posts to the engine on connections of its own instead of aiohttp's
client, and passes a streamed reply's chunks on from the engine connection's
``data_received`` to the client's transport (``relay.py``), waking no task per chunk: what a
relay below aiohttp's stream API could cost a chunk on the same server stack.
``--protocol-reads``: the same engine leg, but the handler reads each chunk and writes it
through aiohttp's response.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import sys
from collections.abc import AsyncIterator

import aiohttp
import relay
from aiohttp import web

from smetric.serve.workers import new_event_loop


def app(engines: list[str]) -> web.Application:
    turns = itertools.cycle(engines)
    clients: list[aiohttp.ClientSession] = []

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with clients[0].post(next(turns) + request.path, data=body, headers=headers) as up:
            if up.content_type != "text/event-stream":
                reply = await up.read()
                return web.Response(body=reply, status=up.status, content_type=up.content_type)
            stream_type = {"Content-Type": up.content_type}
            response = web.StreamResponse(status=up.status, headers=stream_type)
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def client(_: web.Application) -> AsyncIterator[None]:
        clients.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
        yield
        await clients[0].close()

    application = web.Application(client_max_size=64 << 20)
    application.router.add_post("/v1/chat/completions", forward)
    application.cleanup_ctx.append(client)
    return application


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    port, workers, engines = int(args[0]), int(args[1]), args[2:]
    make_app = app
    if "--protocol-relay" in sys.argv:
        make_app = relay.app
    elif "--protocol-reads" in sys.argv:
        make_app = functools.partial(relay.app, callbacks=False)
    sock = socket.create_server(("127.0.0.1", port), backlog=1024)
    print(f"pass-through on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    for _ in range(workers - 1):
        if os.fork() == 0:
            break
    web.run_app(
        make_app(engines),
        sock=sock,
        print=None,
        access_log=None,
        handler_cancellation=True,
        loop=new_event_loop(),
    )


if __name__ == "__main__":
    main()
