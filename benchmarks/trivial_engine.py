"""A stand-in engine that answers every completion at once: it reads the body and replies
with a fixed chat completion, so a benchmark through it measures the router, not the engine.
A body whose last 4 KB ask for a stream (``"stream": true`` or ``"stream":true``: all of
a tiny body, where a router that re-encodes bodies, as smg does, may move it) gets
``CHUNKS`` chunks of one token each (``STREAM_CHUNKS`` unless given), a millisecond apart
as a decode's tokens are spaced, so that a router that keeps up reads each on its own.

    python benchmarks/trivial_engine.py PORT [CHUNKS]

PORT 0 takes a free one; the startup line ("... on http://127.0.0.1:PORT") names it.

It also answers what routers probe at start (``/health``, ``/model_info``,
``/server_info``, ``/v1/models``).
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys

from aiohttp import web

COMPLETION = (
    b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)


STREAM_CHUNKS = 64
# As a client writes it, or as a router that re-encodes the body does (no space).
ASKS_STREAM = re.compile(rb'"stream": ?true')
CHUNK = (
    b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
    b'"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
)
CHUNKS = web.AppKey("chunks", int)
END = web.AppKey("end", bytes)


def last_chunk(chunks: int) -> bytes:
    """The stream's end: its usage (one prompt token, ``chunks`` generated), then [DONE]."""
    usage = (
        f'"usage":{{"prompt_tokens":1,"completion_tokens":{chunks},"total_tokens":{chunks + 1}}}'
    )
    return (
        b'data: {"id":"x","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
        b'"delta":{},"finish_reason":"stop"}],' + usage.encode() + b"}\n\ndata: [DONE]\n\n"
    )


async def complete(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    # Only the tail, where a tiny body is whole: a stand-in costs next to nothing.
    if ASKS_STREAM.search(body, max(0, len(body) - 4096)) is None:
        return web.Response(body=COMPLETION, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(request.app[CHUNKS]):
        await response.write(CHUNK)
        await asyncio.sleep(0.001)
    await response.write(request.app[END])
    await response.write_eof()
    return response


async def info(request: web.Request) -> web.Response:
    return web.json_response({"model_path": "m", "data": [{"id": "m", "object": "model"}]})


def main() -> None:
    app = web.Application(client_max_size=64 << 20)
    app[CHUNKS] = int(sys.argv[2]) if len(sys.argv) > 2 else STREAM_CHUNKS
    app[END] = last_chunk(app[CHUNKS])
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
