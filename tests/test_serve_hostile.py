"""What a careless or hostile client can do to the router, over real HTTP on loopback:
steer engines to an address of its choosing, get its secrets logged, stall a stream by
not reading it, trickle a body; and the faults a cluster throws at the service itself."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_serve import CHAT, FAST, conversation
from test_serve_faults import assert_openai_error, no_load_left, with_mixed

from smetric.engine import EngineConfig, create_app
from smetric.engine.disagg import PULL_PATH
from smetric.serve.engine_client import EngineClient
from smetric.serve.engines import Engine
from smetric.serve.logs import redact
from smetric.serve.upstream import Attempt
from smetric.serve.upstream import Timeouts as UpstreamTimeouts
from smetric.testing.engines import metric
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.faulty import FaultyEngine
from smetric.trace.recording import read_segments
from smetric.trace.recording_format import MANIFEST, SEGMENT_GLOB

from conftest import eventually, run

pytestmark = [pytest.mark.server, pytest.mark.subprocess]


class Listener:
    """A server on loopback that counts who connects to a KV side channel: where a
    client would like an engine to read KV from."""

    def __init__(self) -> None:
        self.pulls = 0

    async def start(self) -> int:
        """Listen; the port."""

        async def pull(request: web.Request) -> web.Response:
            self.pulls += 1
            return web.json_response({"blocks": 0})

        app = web.Application()
        app.router.add_post(PULL_PATH, pull)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        assert self.server.port is not None
        return self.server.port

    async def close(self) -> None:
        await self.server.close()


def steering(port: int) -> dict[str, Any]:
    """A chat request whose ``kv_transfer_params`` send the engine to 127.0.0.1:``port``."""
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "attacker",
        "remote_block_ids": [0, 1, 2],
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_request_id": "x",
    }
    return {
        "model": "m",
        "messages": conversation(1, 0),
        "max_tokens": 4,
        "kv_transfer_params": params,
    }


def steered(allow: bool) -> int:
    """The connections the client's address got from the engine, through ``serve``."""

    async def body(client: aiohttp.ClientSession, url: str, router, fakes) -> int:
        listener = Listener()
        port = await listener.start()
        try:
            for stream in (False, True):
                payload = {**steering(port), "stream": stream}
                async with client.post(url + "/v1/chat/completions", json=payload) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
            async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
                assert response.status == 200
            return listener.pulls
        finally:
            await listener.close()

    if allow:
        return run(lambda: with_mixed([], 1, body, allow_client_kv_transfer_params=True))
    return run(lambda: with_mixed([], 1, body))


def test_a_client_s_kv_transfer_params_never_reach_an_engine() -> None:
    assert steered(allow=False) == 0


def test_the_operator_can_let_clients_send_kv_transfer_params() -> None:
    # The same requests reach the client's address when allowed: the test above can fail.
    assert steered(allow=True) == 2


def test_secrets_never_reach_the_log_at_any_level(tmp_path: Path) -> None:
    """``smetric serve --log-level debug`` in front of an engine answering garbage (the
    log gets what the HTTP client said of it), reached with a client's keys: none of them
    is in the log."""

    async def go() -> str:
        fake = await FaultyEngine("garbage").start()
        serve = SmetricProcess(
            tmp_path, args=("serve", "-e", fake.url, "--log-level", "debug", "--retries", "0")
        )
        try:
            await asyncio.to_thread(serve.start)
            await asyncio.to_thread(serve.wait_ready, 60)
            headers = {
                "Authorization": "Bearer sk-SECRET-bearer",
                "x-api-key": "sk-SECRET-xkey",
                "api-key": "sk-SECRET-azure",
            }
            async with aiohttp.ClientSession() as client:
                for stream in (False, True):
                    payload = {**CHAT, "stream": stream}
                    async with client.post(
                        serve.url + "/v1/chat/completions", json=payload, headers=headers
                    ) as response:
                        assert response.status == 502, await response.text()
        finally:
            await asyncio.to_thread(serve.stop)
            await fake.close()
        return serve.log_since_start()

    log = run(go)
    assert '"event": "engine_failed"' in log and "HttpParserError" in log, log
    assert "SECRET" not in log, log


def test_redaction_covers_headers_schemes_and_urls_in_any_quoting() -> None:
    lines = [
        "headers=<CIMultiDictProxy('Authorization': 'Bearer sk-S1', 'X-Api-Key': 'sk-S2')>",
        json.dumps({"headers": {"authorization": "Basic dXNlcjpTRUNSRVQ=", "api-key": "S3"}}),
        json.dumps({"detail": "{'x-api-key': 'sk-S4'}"}),
        "Authorization: Bearer sk-S5\r\nx-api-key: sk-S6\r\n",
        '{"engine": "http://user:pw-S7@10.0.0.1:8000", "url": "http://h/v1?api_key=S8&x=1"}',
    ]
    for line in lines:
        out = redact(line)
        assert "[redacted]" in out, out
        assert not re.search(r"S[1-8]", out), out
    kept = '{"event": "route", "prompt_tokens": 5, "engine": "http://127.0.0.1:8000"}'
    assert redact(kept) == kept


def slow_reader(port: int, payload: dict[str, Any]) -> socket.socket:
    """A client that sends ``payload`` as a streaming chat request, reads the first piece
    of the reply and then stops reading, with a receive window of a few kB."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(payload).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    return sock


def test_a_client_that_stops_reading_never_gets_a_healthy_engine_ejected() -> None:
    """A long stream to a client that stops reading blocks the relay; the engine behind
    it has done nothing wrong, and stays in (short stall timeouts: it would be out in
    about a second), serving the next client."""

    async def body(client: aiohttp.ClientSession, url: str, router, fakes) -> None:
        port = int(url.rsplit(":", 1)[1])
        payload = {**CHAT, "stream": True, "max_tokens": 150_000}
        sock = await asyncio.to_thread(slow_reader, port, payload)
        try:
            engine = router.engines[0]
            # The relay blocks once the router's socket buffers are full: then nothing
            # is read from the engine for several stall timeouts.
            stall_s = router.settings.stall_timeout_s

            def unread_s() -> float:
                return time.monotonic() - engine.progressed_at

            await eventually(lambda: unread_s() > 3 * stall_s or not engine.healthy, 60)
            assert engine.healthy
            exposition = router.metrics.exposition(router.engines).decode()
            assert metric(exposition, "smetric_engine_stalls_total") == 0
            async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
                assert response.status == 200, await response.text()
        finally:
            sock.close()
        await eventually(no_load_left(router), 30)
        assert engine.healthy

    engine = EngineConfig(speed=0.0001, kv_blocks=32_768, default_max_tokens=8)
    run(lambda: with_mixed([], 1, body, engine_config=engine, stall_timeout_s=1.0))


def http_1_0_stream(port: int, payload: dict[str, Any]) -> bytes:
    """What an HTTP/1.0 client gets for a streaming chat request, to the connection's end."""
    body = json.dumps(payload).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        answer = b""
        while piece := sock.recv(65536):
            answer += piece
    return answer


def test_an_http_1_0_client_gets_its_stream_unframed_to_the_connection_s_end() -> None:
    """HTTP/1.0 has no chunks: the relay passes a stream's events on as they are, and
    the end of the connection ends the body."""

    async def body(client: aiohttp.ClientSession, url: str, router, fakes) -> None:
        port = int(url.rsplit(":", 1)[1])
        payload = {**CHAT, "stream": True, "max_tokens": 40}
        answer = await asyncio.to_thread(http_1_0_stream, port, payload)
        head, _, events = answer.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].endswith(b" 200 OK"), head
        assert b"transfer-encoding" not in head.lower()
        lines = [line for line in events.split(b"\n") if line]
        assert len(lines) > 3 and all(line.startswith(b"data: ") for line in lines), events
        assert lines[-1] == b"data: [DONE]"
        await eventually(no_load_left(router), 30)

    run(lambda: with_mixed([], 1, body))


def test_an_engine_s_silence_starts_again_once_a_slow_client_took_its_bytes() -> None:
    """While a relay waits on its client, the engine owes nothing; once the client took
    the bytes, the engine's silence is measured from then, unless another request was
    waiting on the engine meanwhile (its silence then counts as before)."""

    async def go() -> None:
        engine = Engine("http://127.0.0.1:1", 16)
        async with (
            EngineClient() as client,
            Attempt(engine, client, UpstreamTimeouts(), 0, 0) as attempt,
        ):
            engine.progressed_at -= 100
            await attempt.deliver(asyncio.sleep(0.01))
            assert time.monotonic() - engine.progressed_at < 5
            async with Attempt(engine, client, UpstreamTimeouts(), 0, 0):
                engine.progressed_at -= 100
                await attempt.deliver(asyncio.sleep(0.01))
                assert time.monotonic() - engine.progressed_at > 99

    run(go)


def trickle(port: int, every_s: float) -> tuple[bytes, float]:
    """Headers promising a 1,000-byte body, then one byte every ``every_s``: what the
    router answered, and after how long."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        sock.settimeout(every_s)
        answer = b""
        while time.monotonic() - started < 30:
            try:
                piece = sock.recv(65536)
            except TimeoutError:
                sock.sendall(b" ")
                continue
            except ConnectionResetError:
                # The router closed the connection as a byte of ours was on its way,
                # after its answer, which was read before.
                break
            if not piece:
                break  # the router closed the connection
            answer += piece
    return answer, time.monotonic() - started


def test_a_trickled_body_is_cut_with_a_408_at_the_body_deadline() -> None:
    async def body(client: aiohttp.ClientSession, url: str, router, fakes) -> None:
        port = int(url.rsplit(":", 1)[1])
        answer, took_s = await asyncio.to_thread(trickle, port, 0.3)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        error = json.loads(payload)["error"]
        assert error["code"] == 408 and "1.5 s" in error["message"]
        assert 1.5 <= took_s < 10  # cut at the deadline, the connection closed after it
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            assert response.status == 200  # nothing else held up

    run(lambda: with_mixed([], 1, body, body_timeout_s=1.5))


def test_the_recorder_makes_its_folder_again_and_counts_the_rows_it_lost(
    tmp_path: Path,
) -> None:
    """``serve --record DIR``: DIR deleted while serving is made again (manifest and
    all) for the next requests; while DIR cannot be made (a file stands there), their
    rows are lost, counted as dropped in the next segment, and leave no partial file."""
    folder = tmp_path / "recording"

    async def go() -> None:
        engine = TestServer(create_app(FAST), host="127.0.0.1")
        await engine.start_server()
        serve = SmetricProcess(
            tmp_path,
            args=(
                *("serve", "-e", f"http://127.0.0.1:{engine.port}"),
                *("--record", str(folder), "--record-rotate", "0.2"),
            ),
        )
        try:
            await asyncio.to_thread(serve.start)
            await asyncio.to_thread(serve.wait_ready, 60)
            async with aiohttp.ClientSession() as client:

                async def send(count: int) -> None:
                    for _ in range(count):
                        async with client.post(
                            serve.url + "/v1/chat/completions", json=CHAT
                        ) as response:
                            assert response.status == 200

                await send(3)
                await eventually(lambda: recorded(folder) == (3, 0), 20)
                shutil.rmtree(folder)
                await send(2)
                await eventually(lambda: recorded(folder) == (2, 0), 20)
                assert (folder / MANIFEST).exists()
                shutil.rmtree(folder)
                folder.write_text("in the way")
                await send(2)
                await asyncio.sleep(1.0)  # a few rotations, each failing
                folder.unlink()
                await send(1)
                await eventually(lambda: recorded(folder) == (1, 2), 20)
                assert not list(folder.glob(".*.tmp"))
        finally:
            await asyncio.to_thread(serve.stop)
            await engine.close()
        assert "recording_segment_lost" in serve.log_since_start()

    run(go)


def recorded(folder: Path) -> tuple[int, int]:
    """Rows in the recording's segments, and the rows its recorder said it dropped."""
    if not any(folder.glob(SEGMENT_GLOB)):
        return 0, 0
    rows, dropped = read_segments(folder)
    return rows.height, dropped


async def holding(port: int, size: int) -> asyncio.StreamWriter:
    """A request whose headers promise a body of ``size`` bytes, of which one is sent:
    the router holds room for the rest while it waits."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % size
    )
    await writer.drain()
    return writer


def test_bodies_held_at_once_are_capped_router_wide() -> None:
    """Three requests hold 1 MB each of a 3 MB cap (their bodies still on the way): a
    fourth waits its 2 s and gets a JSON 503 with Retry-After, unread; once one of the
    three is gone, the next is served, and every exit gives its bytes back."""

    async def body(client: aiohttp.ClientSession, url: str, router, fakes) -> None:
        port = int(url.rsplit(":", 1)[1])
        holders = [await holding(port, 1_000_000) for _ in range(3)]
        await eventually(lambda: router.buffered.used == 3_000_000)
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 999_000}]}
        started = time.monotonic()
        async with client.post(url + "/v1/chat/completions", json=big) as response:
            error = await assert_openai_error(response, 503)
            assert response.headers["Retry-After"] == "1"
        assert "limit is 3000000" in error["message"]
        assert 2 <= time.monotonic() - started < 10
        holders.pop().close()
        await eventually(lambda: router.buffered.used == 2_000_000)
        async with client.post(url + "/v1/chat/completions", json=CHAT) as response:
            assert response.status == 200
        for holder in holders:
            holder.close()
        await eventually(lambda: router.buffered.used == 0)

    run(lambda: with_mixed([], 1, body, max_buffered_bytes=3_000_000, body_timeout_s=30))


async def send_head(port: int, headers: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n")
    await writer.drain()
    return reader, writer


def test_a_body_without_a_length_or_compressed_holds_what_has_arrived() -> None:
    """A chunked body holds the bytes read so far, not the per-request limit, and is
    refused with the 503 once its next piece would take the router past the cap; a
    gzipped body holds its Content-Length while it arrives; every exit gives it all
    back."""

    async def body(client: aiohttp.ClientSession, url: str, router, fakes) -> None:
        port = int(url.rsplit(":", 1)[1])
        raw = json.dumps(CHAT).encode()
        reader, writer = await send_head(port, b"Transfer-Encoding: chunked\r\n")
        writer.write(b"%x\r\n%s\r\n" % (10, raw[:10]))
        await eventually(lambda: router.buffered.used == 10)
        writer.write(b"%x\r\n%s\r\n" % (20, raw[10:30]))
        await eventually(lambda: router.buffered.used == 30)
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(raw) - 30, raw[30:]))
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        writer.close()
        await eventually(lambda: router.buffered.used == 0)
        # Compressed: its Content-Length while it arrives.
        zipped = gzip.compress(raw)
        head = b"Content-Encoding: gzip\r\nContent-Length: %d\r\n" % len(zipped)
        reader, writer = await send_head(port, head)
        writer.write(zipped[:5])
        await writer.drain()
        await eventually(lambda: router.buffered.used == len(zipped))
        writer.write(zipped[5:])
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        writer.close()
        await eventually(lambda: router.buffered.used == 0)
        # Two holders of 1 MB leave room for 1 MB more: a chunked body past it is refused.
        holders = [await holding(port, 1_000_000) for _ in range(2)]
        reader, writer = await send_head(port, b"Transfer-Encoding: chunked\r\n")
        piece = b"x" * 600_000
        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await eventually(lambda: router.buffered.used == 2_600_000)
        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await writer.drain()
        status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 503"), status
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        assert b"retry-after: 1\r\n" in head
        writer.close()
        for holder in holders:
            holder.close()
        await eventually(lambda: router.buffered.used == 0)

    run(lambda: with_mixed([], 1, body, max_buffered_bytes=3_000_000, body_timeout_s=30))


def test_an_engine_s_cookie_never_reaches_another_request() -> None:
    """An engine named by host name (as in a cluster's DNS) that sets a cookie, as a
    sticky load balancer or an auth proxy in front of it would, gets it back from no later
    request: the router keeps no cookies of its own, so one client's session cookie is
    never sent on another client's request, nor pins it."""
    from smetric.serve.app import Router, RouterSettings

    from conftest import chat_engine, router_client

    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("Cookie"))
        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}
        response = web.json_response(reply)
        response.set_cookie("session", f"client-{len(seen)}")
        return response

    async def go() -> None:
        async with chat_engine(chat) as port:
            # "localhost", not an IP address: a cookie jar keeps cookies only from names.
            router = Router([Engine(f"http://localhost:{port}", 1000)], RouterSettings())
            async with router_client(router.app(), True, 30) as (client, url):
                for _ in range(3):
                    async with client.post(url + "/v1/chat/completions", json=CHAT) as reply:
                        assert reply.status == 200

    run(go)
    assert seen == [None, None, None]
