"""A stand-in engine that answers every completion at once: it reads the body and replies
with a fixed chat completion, so a benchmark through it measures the router, not the engine.

    python benchmarks/trivial_engine.py PORT

PORT 0 takes a free one; the startup line ("... on http://127.0.0.1:PORT") names it.

It also answers what routers probe at start (``/health``, ``/model_info``,
``/server_info``, ``/v1/models``).
"""

from __future__ import annotations

import socket
import sys

from aiohttp import web

COMPLETION = (
    b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


async def complete(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=COMPLETION, content_type="application/json")


async def info(request: web.Request) -> web.Response:
    return web.json_response({"model_path": "m", "data": [{"id": "m", "object": "model"}]})


def main() -> None:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", complete)
    for path in ("/health", "/model_info", "/server_info", "/get_server_info", "/v1/models"):
        app.router.add_get(path, info)
    try:
        import uvloop
    except ImportError:
        loop_factory = None
    else:
        loop_factory = uvloop.new_event_loop
    sock = socket.create_server(("127.0.0.1", int(sys.argv[1])), backlog=1024)
    print(f"trivial engine on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(
        app,
        sock=sock,
        print=None,
        access_log=None,
        loop=loop_factory() if loop_factory else None,
    )


if __name__ == "__main__":
    main()
