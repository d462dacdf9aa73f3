"""Property-based HTTP fuzzing of the router: hypothesis writes requests (methods, paths,
headers, bodies from raw bytes to nearly valid chats) sent over real HTTP on loopback to a
router in front of a mock engine. The router may refuse anything, but never with a 5xx
of its own, a traceback or a body that is not OpenAI's JSON error shape, and it must serve
a normal request afterwards.

A few hundred examples by default; ``SMETRIC_FUZZ_EXAMPLES=5000`` for a long run.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import logging
import os
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smetric.engine import EngineConfig, create_app
from smetric.serve.app import Router, RouterSettings
from smetric.serve.engines import Engine
from smetric.testing.faulty import FaultyEngine

EXAMPLES = int(os.environ.get("SMETRIC_FUZZ_EXAMPLES", "300"))
KEY = "fuzz-key"
T = TypeVar("T")


@dataclass
class Cluster:
    """A mock engine, an engine answering garbage, and three routers on a loop in a
    thread: ``open`` and ``keyed`` (needing ``KEY``) in front of the mock engine, and
    ``beside_garbage`` in front of both engines, so retries and ejections are fuzzed too."""

    loop: asyncio.AbstractEventLoop
    router_ports: dict[str, int]
    routers: dict[str, Router]


class _Errors(logging.Handler):
    """Collects what the router and aiohttp log as errors: tracebacks land there."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    config = EngineConfig(speed=0.0001, kv_blocks=4096, default_max_tokens=4)
    engine_runner, engine_port = call(_serve(create_app(config)))
    url = f"http://127.0.0.1:{engine_port}"
    garbage = call(FaultyEngine("garbage").start())
    setups = {
        "open": ([url], frozenset()),
        "keyed": ([url], frozenset({KEY})),
        "beside_garbage": ([garbage.url, url], frozenset()),
    }
    routers, runners, ports = {}, [], {}
    for name, (urls, keys) in setups.items():
        engines = [Engine(u, 4096) for u in urls]
        routers[name] = Router(engines, RouterSettings(api_keys=keys, eject_backoff_s=0.2))
        runner, ports[name] = call(_serve(routers[name].app()))
        runners.append(runner)
    try:
        yield Cluster(loop, ports, routers)
    finally:
        for runner in [*runners, engine_runner]:
            call(runner.cleanup())
        call(garbage.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def logged_errors() -> Iterator[_Errors]:
    handler = _Errors()
    loggers = [logging.getLogger(name) for name in ("smetric.serve", "aiohttp.server")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


# -- strategies ---------------------------------------------------------------------------

PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/models",
    "/health",
    "/metrics",
    "/",
    "/v1/chat/completions/extra",
    "/tokenize",
]
text = st.text(max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=20,
)
content_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "tool_result", "tool_use", "x"]) | text},
    optional={"text": text | json_values, "content": json_values, "image_url": json_values},
)
content = text | st.lists(content_part, max_size=3) | json_values
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", ""]) | text},
    optional={"content": content, "name": text, "tool_calls": json_values},
)
request_body = st.fixed_dictionaries(
    {},
    optional={
        "model": text,
        "messages": st.lists(message, max_size=5) | json_values,
        "prompt": text | st.lists(st.integers(-5, 300), max_size=20) | json_values,
        "system": text | json_values,
        "max_tokens": st.integers(-2, 16) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
        "tools": st.lists(json_values, max_size=2) | json_values,
        "chat_template_kwargs": json_values,
    },
)


def _encode(value: object) -> bytes:
    return json.dumps(value).encode()


bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(_encode),
    request_body.map(_encode),
    request_body.map(_encode).map(gzip.compress),
)
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(
    str.strip
)
headers = st.dictionaries(
    st.sampled_from(
        ["Content-Type", "Content-Encoding", "Authorization", "x-api-key", "anthropic-version"]
    ),
    header_values
    | st.sampled_from(["gzip", "deflate", "br", "identity", f"Bearer {KEY}", KEY, "bearer x"]),
    max_size=4,
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "OPTIONS"]),
    path=st.sampled_from(PATHS),
    headers=headers,
    body=bodies,
    router=st.sampled_from(["open", "keyed", "beside_garbage"]),
)
def test_no_request_makes_the_router_fail(
    cluster: Cluster,
    logged_errors: _Errors,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    router: str,
) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", cluster.router_ports[router], timeout=20)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    assert response.status < 500, (response.status, data[:300])
    assert b"Traceback" not in data
    if response.status >= 400:
        assert response.getheader("Content-Type", "").startswith("application/json"), data[:200]
        answer = json.loads(data)
        error = answer["error"]
        if path.split("?")[0].startswith("/v1/messages"):  # Anthropic's shape
            assert answer["type"] == "error" and error["type"] and error["message"]
        else:
            assert error["message"] and error["code"] == response.status
    assert not logged_errors.records, logged_errors.records[0].getMessage()


def test_the_router_is_healthy_after_the_fuzzing(cluster: Cluster) -> None:
    """Runs after the fuzz (tests run in file order): the mock engine still in everywhere,
    nothing left in flight."""
    chat = {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2}
    for name, port in cluster.router_ports.items():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        auth = {"Authorization": f"Bearer {KEY}"} if name == "keyed" else {}
        connection.request("POST", "/v1/chat/completions", body=_encode(chat), headers=auth)
        response = connection.getresponse()
        assert response.status == 200, response.read()[:300]
        response.read()
        connection.close()
        router = cluster.routers[name]
        assert router.engines[-1].healthy
        assert all(e.inflight == 0 and e.unprefilled == 0 for e in router.engines)
