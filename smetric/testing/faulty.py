"""Misbehaving engines on loopback, for the fault tests and ``benchmarks/faults.py``.

Each one answers ``/health`` like a healthy engine (so only the router's own handling of
its replies can keep traffic away from it) and fails every generation request in one way
that real engines, or the proxies and crashes in front of them, do. A raw asyncio server
rather than aiohttp: garbage bytes, a body shorter than its ``Content-Length`` and a stall
after the headers are below what an HTTP framework lets a handler do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Literal

Fault = Literal[
    "stall",  # accepts the request, never answers (nor /v1/models)
    "stall_mid_stream",  # SSE headers and one chunk, then nothing
    "http_500",  # a JSON 500 to every generation
    "garbage",  # bytes that are not HTTP, then hangs up
    "text_413",  # a plain-text 413, as a proxy or an engine's web server sends it
    "truncated_json",  # a 200 whose JSON body stops halfway
    "broken_stream",  # SSE headers and one chunk, then hangs up mid-stream
]
FAULTS: tuple[Fault, ...] = (
    "stall",
    "stall_mid_stream",
    "http_500",
    "garbage",
    "text_413",
    "truncated_json",
    "broken_stream",
)

_CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def _reply(status: str, content_type: str, body: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {size}\r\n\r\n"
    return head.encode() + body


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_MODELS = json.dumps({"object": "list", "data": [{"id": "faulty", "object": "model"}]}).encode()
_ERROR_500 = json.dumps({"error": {"message": "internal engine error", "code": 500}}).encode()


class FaultyEngine:
    """An engine on ``127.0.0.1`` that fails generation with ``fault``; ``generations``
    counts the generation requests it received."""

    def __init__(self, fault: Fault) -> None:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; expected one of {', '.join(FAULTS)}")
        self.fault = fault
        self.generations = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._closed = asyncio.Event()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the engine first"
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> FaultyEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while not self._closed.is_set():
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1] if " " in lines[0] else "/"
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                await reader.readexactly(length)
                if not await self._answer(path, writer):
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, path: str, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must end."""
        if path == "/health":
            writer.write(_reply("200 OK", "text/plain", b""))
            await writer.drain()
            return True
        if path == "/v1/models" and self.fault != "stall":
            writer.write(_reply("200 OK", "application/json", _MODELS))
            await writer.drain()
            return True
        if path not in ("/v1/models", "/metrics"):
            self.generations += 1
        fault = self.fault
        if fault in ("stall", "stall_mid_stream", "broken_stream"):
            if fault != "stall":
                writer.write(_SSE_HEAD + _chunked(_CHUNK))
                await writer.drain()
            if fault != "broken_stream":
                await self._closed.wait()
            return False
        if fault == "http_500":
            writer.write(_reply("500 Internal Server Error", "application/json", _ERROR_500))
        elif fault == "text_413":
            writer.write(_reply("413 Payload Too Large", "text/plain", b"Request Entity Too Large"))
        elif fault == "truncated_json":
            body = b'{"id": "cmpl-1", "choices": [{"index": 0, "message": {"content": "h'
            writer.write(_reply("200 OK", "application/json", body, length=len(body) * 2))
        else:  # garbage
            writer.write(b"\x16\x03\x01\x02\x00 this is not HTTP at all\r\n\r\n")
        await writer.drain()
        return fault in ("http_500", "text_413")
