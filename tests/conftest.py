"""Shared test helpers: where the real public traces live, small trace builders, and the
marks that sort tests into tiers (checked: see ``_tier_marks_are_honest``)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.process
import socket
import subprocess
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import polars as pl
import pytest
from aiohttp import web
from hypothesis import strategies as st

from smetric.trace.schema import Trace, finalize

T = TypeVar("T")

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.fixture(autouse=True)
def _tier_marks_are_honest(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Fail a test that starts a process or listens on a socket without the mark that says
    so (``subprocess``, ``server``), so that the fast tier stays fast as tests are added.

    The calls are recorded, not refused: a server thread that cannot start would leave
    its test waiting rather than failing.
    """
    found: set[str] = set()

    def watch(mark: str, cls: Any, name: str, what: str) -> None:
        # The real-engine and browser tiers start what they need and never run fast.
        if any(request.node.get_closest_marker(m) for m in (mark, "real_engine", "browser")):
            return
        original = getattr(cls, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            found.add(f"{what}: mark it (or its module) pytest.mark.{mark}")
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)

    watch("subprocess", subprocess.Popen, "__init__", "it starts a process")
    watch("subprocess", multiprocessing.process.BaseProcess, "start", "it starts a process")
    watch("server", socket.socket, "listen", "it listens on a socket")
    yield
    if found:
        pytest.fail(f"{request.node.nodeid}: {'; '.join(sorted(found))}", pytrace=False)


def run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine ``make()`` returns to completion in a fresh event loop."""
    return asyncio.run(make())


async def eventually(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Poll rather than sleep a fixed time: servers and health checks run late on a busy
    machine."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not met within {timeout_s:g} s"
        await asyncio.sleep(0.02)


def real_trace(relative: str) -> Path:
    path = SHARED_TRACES / relative
    if not path.exists():
        pytest.skip(f"real trace {path} is not present on this machine")
    return path


def make_trace(rows: list[dict], *, has_clock: bool = False, name: str = "hand-made") -> Trace:
    """A trace from hand-written rows; columns left out take the schema's defaults."""
    return Trace(finalize(pl.DataFrame(rows)), name, "test", has_clock)


def _chained(choices: list[int]) -> tuple[int, ...]:
    value, out = 1, []
    for choice in choices:
        value = value * 4 + choice + 1
        out.append(value)
    return tuple(out)


# Sequences from a small trie, so that cached prefixes are shared and diverge inside runs:
# chained ids (an id encodes its whole prefix, as the traces' do) or raw ids from three
# letters (the same id at several depths and paths: a tree must not rely on chaining).
TRIE_SEQUENCES = st.one_of(
    st.lists(st.integers(0, 2), max_size=14).map(_chained),
    st.lists(st.integers(1, 3), max_size=10).map(tuple),
)


def tiny_sim_yaml(indent: int) -> str:
    """A preset's ``config`` and ``tiers`` for the smallest simulation whose knee searches
    still settle (two instances, three minutes of the bundled weka sample), ``indent``
    spaces deep: ``reproduce`` and ``grid`` presets nest them at different depths."""
    text = """\
config:
  cluster: {instances: 2}
  workload: {trace: sample:weka, duration_s: 180}
  warmup_s: 30
  window_s: 30
tiers: {none: 0.02, full: 0.04}
"""
    return textwrap.indent(text, " " * indent)


def events_engine(port: int, events_port: int, replay_port: int, topic: str, **extra: str) -> str:
    """One item of a router config's ``engines:`` list: an engine whose KV events the
    router subscribes to on loopback (``extra``: more ``kv_events`` keys, as YAML)."""
    keys = "".join(f", {key}: {value}" for key, value in extra.items())
    return (
        f"  - url: http://127.0.0.1:{port}\n"
        f"    kv_events: {{endpoint: 'tcp://127.0.0.1:{events_port}', topic: {topic}, "
        f"replay_endpoint: 'tcp://127.0.0.1:{replay_port}'{keys}}}\n"
    )


# Bound, never listening, held until the run ends: connections to these ports are
# refused (a dead engine), and no server started meanwhile can be given one of them.
_REFUSING: list[socket.socket] = []


def closed_port() -> int:
    """A loopback port that refuses connections for the rest of the run."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _REFUSING.append(sock)
    return int(sock.getsockname()[1])


def zmq_port(endpoint: str) -> int:
    """The port of a bound ZMQ endpoint as the socket reports it (``tcp://HOST:PORT``)."""
    return int(endpoint.rsplit(":", 1)[1])


def block_stored(
    hashes: list[Any], parent: Any, tokens: list[int], block_size: int, medium: Any = "GPU"
) -> dict[str, Any]:
    """A BlockStored event as recent vLLM encodes it (map form), fields the router ignores
    included."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": 0,
    }


async def until_heard(
    send: Callable[[int], Awaitable[Any]], heard: Callable[[], bool], tries: int = 40
) -> None:
    """Send small requests (``send(attempt)``) until ``heard()``: a ZMQ subscriber misses
    what is published before its subscription reaches the publisher (the slow joiner,
    slower on a busy machine), so a test waits for proof that the stream flows rather
    than sleeping and hoping."""
    loop = asyncio.get_running_loop()
    for attempt in range(tries):
        await send(attempt)
        deadline = loop.time() + 0.5
        while loop.time() < deadline:
            if heard():
                return
            await asyncio.sleep(0.01)
    raise AssertionError(f"no KV-event batch was heard after {tries} requests")


@contextlib.asynccontextmanager
async def chat_engine(
    chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[int]:
    """An engine on loopback that answers chat completions with ``chat`` and is healthy;
    its port, while the block runs."""

    async def healthy(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", healthy)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def router_client(
    app: web.Application, handler_cancellation: bool, timeout_s: float
) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """A router app served on loopback and a client without a connection cap, every
    request within ``timeout_s``. Not a TestServer: that always cancels the handlers of
    clients that went away, which the hang-up tests must be able to turn off."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        unlimited = aiohttp.TCPConnector(limit=0)
        async with asyncio.timeout(timeout_s), aiohttp.ClientSession(connector=unlimited) as client:
            yield client, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
